# Sourced by the other scripts with the extras they need, e.g.
#     source scripts/_env.sh examples
# Makes a virtual environment in .venv (once) and installs eqpar with those extras, and again
# whenever pyproject.toml changes. The stamp lists the extras installed since pyproject.toml
# last changed, so the demo after the tests (whose extras include the demo's) installs
# nothing, and the tests after the demo install only what the demo left out.
#
# PYTHON=/path/to/python3.13 picks the interpreter (default: `python3`); the environment is
# made again from scratch when it was made by another interpreter, since pip resolves other
# releases for another Python (JAX >= 0.11 needs Python >= 3.12). EQPAR_VENV names the
# environment's folder (default .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${1:?usage: source scripts/_env.sh EXTRA[,EXTRA...] (the extras of pyproject.toml)}"
PYTHON="${PYTHON:-python3}"
VENV="${EQPAR_VENV:-.venv}"
# An interpreter is its installation (a venv's base_prefix is its maker's prefix) and version.
IDENTITY='import sys; print(sys.base_prefix, sys.version.split()[0])'
WANTED="$("$PYTHON" -c "$IDENTITY")"
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c "$IDENTITY")" != "$WANTED" ]; then
    echo "$VENV was made by another Python than $PYTHON ($WANTED): making it again" >&2
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.eqpar-installed"
INSTALLED=""
if [ -f "$STAMP" ] && [ ! pyproject.toml -nt "$STAMP" ]; then
    INSTALLED="$(cat "$STAMP")"
fi
MISSING=""
for extra in ${EXTRAS//,/ }; do
    case " $INSTALLED " in
        *" $extra "*) ;;
        *) MISSING="$MISSING $extra" ;;
    esac
done
if [ -n "$MISSING" ]; then
    echo "installing eqpar[$EXTRAS] into $VENV (missing:$MISSING)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]"
    # Written after the install: an interrupted install leaves the stamp as it was.
    echo "$(printf '%s\n' $INSTALLED ${EXTRAS//,/ } | sort -u | tr '\n' ' ')" > "$STAMP"
fi
export PATH="$ROOT/$VENV/bin:$PATH"
