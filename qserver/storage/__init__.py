"""LMDB storage of one node: queue records and messages, the membership log, journal export."""
