# Sourced by scripts/demo and scripts/test: a Python >= 3.11 virtualenv in .venv with poold installed.
# On a fresh Debian machine (as root) it installs what venv needs from Debian's packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

find_python() {
    for py in python3.11 python3.12 python3.13 python3; do
        if command -v "$py" >/dev/null 2>&1 &&
           "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    return 1
}

apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: apt-get install $*" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null ||
            { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
    else
        echo "bootstrap: please install: $*" >&2; return 1
    fi
}

PY="$(find_python)" || { apt_install python3 python3-venv; PY="$(find_python)"; }
if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    apt_install "$(basename "$PY")-venv" || apt_install python3-venv
fi

EXTRAS="${POOLD_EXTRAS:-}"
STAMP=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$STAMP"
fi
