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

ensure_java() {   # Spark 4 (qaudit) needs Java 17+; installs Debian's headless JRE when it is missing
    local version
    version=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
    if [ -n "$version" ] && [ "$version" -ge 17 ]; then
        return 0
    fi
    echo "installing Java 17 (openjdk-17-jre-headless) for Spark ..."
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq > .venv/apt.log 2>&1 \
        && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >> .venv/apt.log 2>&1 \
        || { cat .venv/apt.log; exit 1; }
}

ensure_debian_packages() {   # $@: "command:package" pairs; installs the packages whose command is missing
    local missing=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" > /dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "installing ${missing[*]} from Debian's packages ..."
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq > .venv/apt.log 2>&1 \
        && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >> .venv/apt.log 2>&1 \
        || { cat .venv/apt.log; exit 1; }
}
