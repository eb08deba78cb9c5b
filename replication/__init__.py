"""Pure protocol cores of the queue cluster.

Nothing here imports asyncio, aiohttp, lmdb, time or socket (tests/test_purity.py holds us
to that): time arrives as arguments, storage is read through the narrow `StoreReader`
interface, and every change comes back as typed operations for the node to persist, send
and answer in that order. The node (`qserver/`) owns each core through one task.
"""
