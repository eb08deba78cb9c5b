# Sourced by scripts/demo and scripts/test: make .venv and install the project into it.
# Needs only python3 (3.11+) from the operating system image; everything else comes from PyPI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
install_project() {   # $1: extras, e.g. "server" or "server,dev"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]"
}
