#!/usr/bin/env bash
# Set everything up in .venv (idempotent), then run the default training job or the test suite.
#   ./quickstart.sh train [extra ddp-app overrides...]
#   ./quickstart.sh test  [extra pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv

setup() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        "$PYTHON" -m venv "$VENV"
    fi
    # The stamp skips the install when pyproject.toml and constraints.txt are unchanged.
    local stamp="$VENV/.installed"
    if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" || constraints.txt -nt "$stamp" ]]; then
        "$VENV/bin/python" -m pip install --quiet --upgrade pip
        "$VENV/bin/python" -m pip install --quiet -c constraints.txt -e ".[dev]"
        touch "$stamp"
    fi
}

case "${1:-}" in
    train)
        shift
        setup
        exec "$VENV/bin/ddp-app" fit --config configs/digits.yaml "$@"
        ;;
    test)
        shift
        setup
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    setup)
        setup
        ;;
    *)
        echo "usage: $0 {train|test|setup} [args...]" >&2
        exit 2
        ;;
esac
