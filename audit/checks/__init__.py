"""The audit's checks (docs/AUDIT.md): the one definition of "correct" for qaudit's Spark job,
its pure-Python path, the chaos runner and the tests.

Spark only reads the exported journal files, brings each queue group's records together and
hands them to `group.check_group`; the pure-Python path (audit/local.py) does the same with
plain lists. Both then call `report.assemble_report`. So the two paths cannot disagree about
what a violation is, only about how the records travelled (which tests/test_audit.py compares).

    units.py         the units of work: journals, queue groups, streams, incarnations
    violations.py    violation and flag kinds, a violation's shape, the settings
    journals.py      one journal's sequence numbers
    replay.py        what one member's stream shows (StreamReplay), message states
    indexes.py       ordering indices of a stream: continuity, epoch bases, discarded suffixes
    messages.py      each message's life in a stream: leases, acks, delivery order, redeliveries
    streams.py       the replay loop that drives the two above
    incarnations.py  which streams belong together; a dead-letter queue's derived arrivals
    members.py       members against each other: agreement, one master per epoch, the timeline
    queues.py        one queue: nothing committed lost, no retry stored twice; its summary
    history.py       the client-side history against the journals
    group.py         every check on one queue group
    report.py        the verdict from every journal's and group's results

The journal's format (fields, run records, op names, `JournalRecord`) is the node's as much as
the audit's: it lives in replication/journal.py, which these modules read and never extend.

Pure: no I/O, no clock, no pyspark (the chaos runner uses these without the `audit` extra).
Records are `JournalRecord` tuples; results are JSON-ready dicts whose lists are sorted, so
equal inputs give equal results whichever path produced them.
"""
