"""qaudit: replay every node's journal and prove (or disprove) that nothing was lost,
duplicated or reordered (docs/AUDIT.md).

    checks/       the checks themselves: pure, no pyspark (the chaos runner uses them too)
    inputs.py     where journals come from (exported Parquet, or an LMDB environment exported
                  on the fly) and the client history file
    local.py      the pure-Python path (small inputs, tests, no JVM)
    spark_job.py  the PySpark job (local[*] by default, any --master for scale)
    html.py       the HTML page (inline SVG charts) made from the JSON report
    cli.py        the `qaudit` command

Both paths hand the records to the same pure checkers (audit/checks/), so they give the same
report on the same data. The journal's format is the node's as much as the audit's:
replication/journal.py.
"""
