"""qaudit: replay every node's journal and prove (or disprove) that nothing was lost,
duplicated or reordered (DESIGN.md 4.6).

    inputs.py     where journals come from (exported Parquet, or an LMDB environment exported
                  on the fly) and the client history file
    local.py      the pure-Python path (small inputs, tests, no JVM)
    spark_job.py  the PySpark job (local[*] by default, any --master for scale)
    html.py       the HTML page (inline SVG charts) made from the JSON report
    cli.py        the `qaudit` command

Both paths hand the records to the same pure checkers (replication/audit_checks.py), so they
give the same report on the same data.
"""
