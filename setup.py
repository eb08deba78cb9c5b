"""Everything about the package is in pyproject.toml; this file only adds `qcluster-kombu.pth`.

kombu has no entry point for transports (docs/CELERY.md, "How qcluster:// is found"), so the
package installs a `.pth` file at the top of site-packages whose one line imports
`_qcluster_kombu_alias` (a top-level module of this package: pyproject's `py-modules`). A `.pth`
file is not a package's data, so no pyproject setting can place it: `build_py` writes it where
the wheel's top level is built, both for a wheel (`build_lib`) and for the editable wheel of
`pip install -e .` (setuptools' editable_wheel builds into a temporary directory and takes what
it installs from the `install` command's `install_lib`, which it points at the wheel's top).
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "qcluster-kombu.pth"
# Guarded so that a removed module (an editable checkout gone) costs a silent no-op, not a
# traceback at every interpreter start.
PTH_LINE = "import sys; exec('try:\\n import _qcluster_kombu_alias\\nexcept ImportError:\\n pass')\n"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib)
        if getattr(self, "editable_mode", False):
            install = self.get_finalized_command("install")
            target = Path(install.install_lib)
        target.mkdir(parents=True, exist_ok=True)
        (target / PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / PTH_NAME))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
