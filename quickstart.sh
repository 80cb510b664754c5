#!/usr/bin/env bash
# Set everything up in .venv (idempotent), then run the default training job or the test suite.
#   ./quickstart.sh train [extra ddp-app overrides...]
#   ./quickstart.sh test  [extra pytest arguments...]   (two workers; -n 0: one process)
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
        # Two workers (pytest-xdist), a module per worker at a time (tests/conftest.py): most tests wait
        # on processes they started. `-n 0` runs in this one process. --no-loadscope-reorder: modules
        # in the order tests/conftest.py gives them (the longest first), not by their number of tests.
        exec "$VENV/bin/python" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder "$@"
        ;;
    setup)
        setup
        ;;
    *)
        echo "usage: $0 {train|test|setup} [args...]" >&2
        exit 2
        ;;
esac
