#!/usr/bin/env bash
# The whole test suite: lint, type check, unit and multi-process tests, docs.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check eqpar tests examples benchmarks
pyright
python -m pytest -n 2 --durations=25 "$@"
