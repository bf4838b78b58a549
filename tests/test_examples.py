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


def test_scripts_install_their_extras_once_per_pyproject_change(tmp_path):
    """`scripts/_env.sh EXTRAS` installs only what is missing since pyproject.toml last
    changed (a stand-in python records the pip calls instead of installing)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "_env.sh").write_text((ROOT / "scripts" / "_env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text("")
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\n')
    fake.chmod(0o755)
    old = os.stat(tmp_path / "pyproject.toml").st_mtime - 10
    os.utime(tmp_path / "pyproject.toml", (old, old))

    def source(extras: str) -> list[str]:
        calls = tmp_path / "calls"
        calls.write_text("")
        subprocess.run(
            ["bash", "-c", f"source scripts/_env.sh {extras}"],
            cwd=tmp_path, check=True, capture_output=True, timeout=60,
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
