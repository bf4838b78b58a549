#!/usr/bin/env bash
# The whole test suite: lint, type check, unit and multi-process tests, docs. Installs the
# extras that the tests run (`test` and `docs`, and `examples`, whose scripts they run).
# PYTHON=/path/to/python picks the interpreter (default `python3`; see scripts/_env.sh).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" examples,test,docs
python -c 'import sys, jax; print(f"tests on Python {sys.version.split()[0]} ({sys.base_prefix}) with JAX {jax.__version__}")'
ruff check eqpar tests examples benchmarks
pyright
python -m pytest -n 2 --durations=25 "$@"
