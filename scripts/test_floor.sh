#!/usr/bin/env bash
# The tests again at the oldest releases pyproject.toml allows (the pins of
# .ci/constraints-floor.txt), in their own environment .venv-floor, so that the floors users are
# promised are floors CI has run. A subset, to stay within CI's time: every module of eqpar/
# is run by at least one test below, chosen among the serial-twin and round-trip tests.
#     bash scripts/test_floor.sh            # the subset
#     bash scripts/test_floor.sh tests/x.py # other tests, at the floor
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV=.venv-floor
CONSTRAINTS=.ci/constraints-floor.txt
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.eqpar-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$CONSTRAINTS" -nt "$STAMP" ]; then
    echo "installing eqpar[test] into $VENV at the floor ($CONSTRAINTS)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[test]" -c "$CONSTRAINTS"
    touch "$STAMP"
fi
# The floor run means something only if the pins are what got installed.
"$VENV/bin/python" - "$CONSTRAINTS" <<'PY'
import re, sys
from importlib.metadata import version
pins = [l.split("#")[0].strip() for l in open(sys.argv[1])]
wrong = [
    f"{name} {version(name)} (pinned {want})"
    for name, want in (p.split("==") for p in pins if p)
    if version(name) != want
]
if wrong:
    sys.exit(f"test_floor.sh: not the floor: {', '.join(wrong)}")
PY
source "$ROOT/scripts/_subset.sh"  # SUBSET: a test of every module of eqpar/
[ "$#" -eq 0 ] && set -- "${SUBSET[@]}"
"$VENV/bin/python" -m pytest -n 2 --durations=10 "$@"
