"""The example scripts run as a user would run them."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_primitives_tour_runs():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "primitives_tour.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "items came from devices [2, 1, 0, 3]" in result.stdout
    assert "round trip exact: True" in result.stdout


def _without_choices() -> dict[str, str]:
    """The environment without the interpreter and environment folder a caller chose (as
    scripts/test_newest.sh does for the tests it runs)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHON", "EQPAR_VENV")}


def test_scripts_install_their_extras_once_per_pyproject_change(tmp_path):
    """`scripts/_env.sh EXTRAS` installs only what is missing since pyproject.toml last
    changed (a stand-in python records the pip calls instead of installing)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "_env.sh").write_text((ROOT / "scripts" / "_env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text("")
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    # It answers `-c` (which interpreter made the environment) as the real python3 does.
    fake.write_text(
        f'#!/bin/sh\n[ "$1" = -c ] && exec python3 "$@"\necho "$*" >> {tmp_path / "calls"}\n'
    )
    fake.chmod(0o755)
    old = os.stat(tmp_path / "pyproject.toml").st_mtime - 10
    os.utime(tmp_path / "pyproject.toml", (old, old))

    def source(extras: str) -> list[str]:
        calls = tmp_path / "calls"
        calls.write_text("")
        subprocess.run(
            ["bash", "-c", f"source scripts/_env.sh {extras}"],
            cwd=tmp_path, check=True, capture_output=True, timeout=60, env=_without_choices(),
        )  # fmt: skip
        return [line for line in calls.read_text().splitlines() if " -e " in line]

    assert source("examples") == ["-m pip install --quiet -e .[examples]"]  # the demo
    assert source("examples") == []
    assert source("examples,test,docs") == ["-m pip install --quiet -e .[examples,test,docs]"]
    assert source("examples") == []  # the demo after the tests
    later = old + 3600  # pyproject.toml changed after the installs: install again
    os.utime(tmp_path / "pyproject.toml", (later, later))
    assert source("examples") == ["-m pip install --quiet -e .[examples]"]
    assert source("examples,test,docs") == ["-m pip install --quiet -e .[examples,test,docs]"]


def test_scripts_make_the_environment_again_for_another_interpreter(tmp_path):
    """`PYTHON=...` naming another interpreter than the one that made `.venv` (another
    version: pip resolves other releases for it) makes `.venv` again with it. Stand-ins:
    an interpreter that says it is Python 3.99 and makes environments of stand-ins."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "_env.sh").write_text((ROOT / "scripts" / "_env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text("")
    calls = tmp_path / "calls"
    says = '#!/bin/sh\n[ "$1" = -c ] && echo "/opt/python 3.99.0" && exit 0\n'
    venv_python = says + f'echo "$*" >> {calls}\n'
    newer = tmp_path / "python3.99"
    newer.write_text(
        venv_python + '[ "$1 $2" = "-m venv" ] && mkdir -p "$3/bin" '
        f"&& printf '%s' '{venv_python}' > \"$3/bin/python\" && chmod +x \"$3/bin/python\"\n"
    )
    newer.chmod(0o755)
    made_before = tmp_path / ".venv" / "bin" / "python"  # made by the real python3
    made_before.parent.mkdir(parents=True)
    made_before.write_text('#!/bin/sh\n[ "$1" = -c ] && exec python3 "$@"\nexit 0\n')
    made_before.chmod(0o755)
    result = subprocess.run(
        ["bash", "-c", "source scripts/_env.sh examples"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**_without_choices(), "PYTHON": str(newer)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "made by another Python" in result.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == "-m venv .venv"  # made again, by the newer interpreter
    assert "-m pip install --quiet -e .[examples]" in lines
