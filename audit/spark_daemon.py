"""PySpark's worker daemon (`pyspark.daemon`), importing pyspark from the installed package
rather than from pyspark.zip (local masters: spark_job.spark_session sets it as
`spark.python.daemon.module`).

Spark puts SPARK_HOME/python/lib/pyspark.zip first on its Python workers' path, and Python
keeps no compiled bytecode for modules imported from a zip: the daemon and each worker it
forks compiled pyspark's modules from source, about 0.5 s of CPU for the daemon alone, every
run, on the path of the first Python task. A pip-installed pyspark (SPARK_HOME is the package
directory) ships that zip inside the package it was built with, so the package directory is
the same code, with its bytecode cached. Any other layout keeps the zip.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def prefer_installed_pyspark(path: list[str]) -> list[str]:
    """`path` with each `<pyspark package>/python/lib/pyspark.zip` replaced by the directory
    that holds the package (site-packages), so that `import pyspark` finds the package."""
    found = []
    for entry in path:
        if entry.endswith("pyspark.zip"):
            package = Path(entry).parent.parent.parent
            if package.name == "pyspark" and (package / "__init__.py").is_file() and (package / "daemon.py").is_file():
                entry = str(package.parent)
        found.append(entry)
    return found


if __name__ == "__main__":
    sys.path[:] = prefer_installed_pyspark(sys.path)
    runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)
