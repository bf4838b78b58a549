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
