"""A training process killed with SIGKILL after a checkpoint resumes exactly where it was."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
STEPS = 8
ARGS = ["--size", "tiny", "--steps", str(STEPS), "--batch-size", "8",
        "--microbatches", "2", "--schedule", "circular"]  # fmt: skip
TIMEOUT = 240


def command(*extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), *ARGS, *extra]


def environment() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def run(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        args, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def saved_steps(directory: pathlib.Path) -> list[int]:
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.multiprocess
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    reference_json = tmp_path / "reference.json"
    reference = subprocess.Popen(
        command("--json", str(reference_json), "--out", str(tmp_path / "ref"), "--no-progress"),
        cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip

    ckpt = tmp_path / "ckpt"
    victim = subprocess.Popen(
        command("--ckpt-dir", str(ckpt), "--save-every", "1", "--out", str(tmp_path / "a"),
                "--no-progress"),
        cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while not saved_steps(ckpt) and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the checkpoint directory, not waiting for a result
        assert victim.poll() is None, "the training finished before it could be killed"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=30)
    killed_at = max(saved_steps(ckpt))
    assert 1 <= killed_at < STEPS

    # The run again from the config.json it wrote beside its checkpoints, with --resume (and
    # its own outputs and progress lines: the killed run had --no-progress).
    resumed_json = tmp_path / "resumed.json"
    result = run(
        [sys.executable, str(SCRIPT), "--config", str(ckpt / "config.json"), "--resume",
         "--json", str(resumed_json), "--out", str(tmp_path / "b"), "--progress",
         "--log-every", "4"],
        tmp_path,
    )  # fmt: skip
    try:
        reference.wait(timeout=TIMEOUT)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait(timeout=30)
    assert reference.returncode == 0, reference.stdout.read().decode() if reference.stdout else ""

    expected = json.loads(reference_json.read_text())
    resumed = json.loads(resumed_json.read_text())
    start = STEPS - len(resumed["losses"])
    assert f"resumed from step {start}" in result.stdout
    assert start >= killed_at
    assert resumed["losses"] == expected["losses"][start:]  # bitwise: same floats
    assert resumed["parameter_digest"] == expected["parameter_digest"]
    assert resumed["config"]["steps"] == STEPS and resumed["config"]["schedule"] == "circular"
    # The loss curve goes on from the restored step, with the killed run's losses before it:
    # the metrics file beside the checkpoints holds one record per step, the killed run's up
    # to the restored step and then the resumed run's.
    assert resumed["curve"] == {"steps": list(range(1, STEPS + 1)), "losses": expected["losses"]}
    records = [json.loads(line) for line in (ckpt / "metrics.jsonl").open()]
    steps = [record["step"] for record in records if "loss" in record]
    assert steps == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records if "loss" in r] == expected["losses"]
    assert f"saved the checkpoint of step {STEPS} in {ckpt}" in result.stdout
    assert (tmp_path / "b" / "loss_curve.png").stat().st_size > 1000
    # Through a pipe, progress is whole lines (no bar redrawn with "\r"), after a note on
    # compiling; tokens/s are measured from the second step on.
    assert "\r" not in result.stdout
    assert "compiling the training step" in result.stdout
    assert f"step {STEPS}/{STEPS}  loss {resumed['losses'][-1]:.4f}  tokens/s " in result.stdout
