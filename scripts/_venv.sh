# Sourced by scripts/demo and scripts/test: make .venv and install the project into it.
# Needs only python3 (3.11+) from the operating system image; everything else comes from PyPI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip > .venv/pip.log 2>&1 \
        || { cat .venv/pip.log; exit 1; }
fi
install_project() {   # $1: extras, e.g. "server" or "server,dev"; skipped while pyproject.toml is unchanged
    local stamp=".venv/.installed-${1//,/-}"
    local wanted
    wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
        echo "installing the project and its dependencies into .venv (extras: $1) ..."
        .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]" > .venv/pip.log 2>&1 \
            || { cat .venv/pip.log; exit 1; }
        echo "$wanted" > "$stamp"
    fi
}
