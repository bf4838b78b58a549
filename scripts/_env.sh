# Sourced by the other scripts with the extras they need, e.g.
#     source scripts/_env.sh examples
# Makes a virtual environment in .venv (once) and installs eqpar with those extras, and again
# whenever pyproject.toml changes. The stamp lists the extras installed since pyproject.toml
# last changed, so the demo after the tests (whose extras include the demo's) installs
# nothing, and the tests after the demo install only what the demo left out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${1:?usage: source scripts/_env.sh EXTRA[,EXTRA...] (the extras of pyproject.toml)}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
STAMP=.venv/.eqpar-installed
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
    echo "installing eqpar[$EXTRAS] into .venv (missing:$MISSING)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
    # Written after the install: an interrupted install leaves the stamp as it was.
    echo "$(printf '%s\n' $INSTALLED ${EXTRAS//,/ } | sort -u | tr '\n' ' ')" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
