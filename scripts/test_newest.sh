#!/usr/bin/env bash
# The tests on the newest Python this machine has (and so the newest JAX pip resolves for
# it: JAX >= 0.11 needs Python >= 3.12), in their own environment .venv-newest, beside the
# whole suite that scripts/test.sh runs on `python3`. A subset by default, to stay within
# CI's time (scripts/_subset.sh: a test of every module of eqpar/), and the memory guard,
# whose records are kept per JAX release.
#     bash scripts/test_newest.sh              # the subset
#     bash scripts/test_newest.sh tests/x.py   # other tests
#     PYTHON=/path/to/python3.13 bash scripts/test_newest.sh   # another interpreter
# Without PYTHON it takes the highest released python3.N among pyenv's versions and the PATH
# (python3 when there is none).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    PYTHON="$(python3 - <<'PY'
import glob, os, re, shutil, subprocess

root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() \
    if shutil.which("pyenv") else ""
# Released CPython builds only: pyenv's "3.14-dev", "3.15.0a1" or free-threaded "3.13.0t"
# may have no JAX wheels.
found = [path for path in glob.glob(os.path.join(root, "versions", "*", "bin", "python3.*"))
         if re.fullmatch(r"\d+\.\d+\.\d+", path.split(os.sep)[-3])] if root else []
found += [path for n in range(8, 30) if (path := shutil.which(f"python3.{n}"))]
versions = {}
for path in found:
    if not re.fullmatch(r"python3\.\d+", os.path.basename(path)):
        continue
    ran = subprocess.run([path, "-c", "import sys; print(*sys.version_info[:2])"],
                         capture_output=True, text=True)
    if ran.returncode == 0:
        versions[path] = tuple(map(int, ran.stdout.split()))
print(max(versions, key=versions.get) if versions else "")
PY
)"
    if [ -z "$PYTHON" ]; then
        PYTHON=python3
        echo "test_newest.sh: no python3.N found (pyenv or PATH): python3 (PYTHON= to choose)" >&2
    fi
fi
export PYTHON EQPAR_VENV=.venv-newest
source "$ROOT/scripts/_env.sh" examples,test,docs
python -c 'import sys, jax; print(f"tests on Python {sys.version.split()[0]} ({sys.base_prefix}) with JAX {jax.__version__}")'
source "$ROOT/scripts/_subset.sh"
[ "$#" -eq 0 ] && set -- "${SUBSET[@]}" tests/test_memory_guard.py
python -m pytest -n 2 --durations=10 "$@"
