#!/usr/bin/env bash
# The whole test suite: lint, type check, unit and multi-process tests, docs. Installs the
# extras that the tests run (`test` and `docs`, and `examples`, whose scripts they run).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" examples,test,docs
ruff check eqpar tests examples benchmarks
pyright
python -m pytest -n 2 --durations=25 "$@"
