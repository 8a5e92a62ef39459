"""Faults under torchrun (gloo, CPU, two ranks): the ranks agree on the end.

Each launch is bounded (a hang fails the test at its timeout) and ends every rank
within 60 s of the fault, with no process of the launch left and no lock held; each
asserts the exit status, the one line and the report's state.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fpaudit
from fpaudit.report.store import Report

from ..conftest import MODELS, ROOT

pytestmark = pytest.mark.slow
MODEL = MODELS / "ranks.py"
PACKAGE = str(Path(fpaudit.__file__).resolve().parent) + os.sep


class Launch:
    """One two-rank ``torchrun ... fpaudit scan`` in a session of its own."""

    def __init__(self, out: Path, fault: str, *extra: str, **env: str) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "-m", "fpaudit", "scan", str(MODEL),
                   "--out", str(out), *extra]  # fmt: skip
        self.out = out
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "FAULT": fault, **env}, start_new_session=True,
        )  # fmt: skip

    def wait(self, *, within: float = 60.0) -> tuple[int, str]:
        """The exit status and stderr; the whole session killed if it outlives ``within``."""
        try:
            _, err = self.process.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            _, err = self.process.communicate()
            pytest.fail(f"the launch did not end within {within} s: {err[-2000:]}")
        time.sleep(0.5)  # the ranks' own exit, after torchrun's
        left = _session_members(self.process.pid)
        assert not left, f"processes left behind: {left}"
        lock = self.out.with_name(self.out.name + ".lock")
        if lock.exists():  # a lock file may stay; nobody may hold it
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        return self.process.returncode, err

    def when(self, path: Path, *, within: float = 90.0) -> None:
        """Wait until ``path`` exists (a rank's steps run)."""
        deadline = time.monotonic() + within
        while not path.exists():
            assert self.process.poll() is None, _ours(self.process.communicate()[1])
            assert time.monotonic() < deadline, "the steps never started"
            time.sleep(0.2)


def _session_members(sid: int) -> list[str]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session
                members.append((entry / "cmdline").read_text().replace("\0", " ")[:120])
        except (OSError, IndexError, ValueError):
            continue
    return members


def _ours(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fpaudit: ")]


def _steps(path: Path) -> dict[int, list[int]]:
    report = Report.read(path)
    return {r: sorted(report.steps[report.steps["rank"] == r]["step"]) for r in report.ranks}


def test_uneven_batches_end_every_rank_at_the_shortest(tmp_path: Path) -> None:
    out = tmp_path / "report"
    code, err = Launch(out, "uneven", "--steps", "6").wait()
    assert code == 0, err[-3000:]
    # rank 1's one-shot generator gave 4 batches, 2 of its shard: both ranks stopped there
    assert _ours(err) == [
        "fpaudit: note: the batches of rank 1 ended after 2 step(s); every rank stopped there"
    ]
    assert _steps(out) == {0: [0, 1], 1: [0, 1]}
    assert Report.read(out).meta["batches_ended_on"] == [1]


def test_a_rank_that_raises_ends_the_other_with_its_words(tmp_path: Path) -> None:
    out = tmp_path / "report"
    code, err = Launch(out, "raise", "--steps", "4").wait()
    assert code != 0
    words = f"{MODEL}:38: loss(model, batch) raised ValueError: bad batch on rank 1"
    lines = _ours(err)
    assert len(lines) == 2 and set(lines) == {
        f"fpaudit: error: rank 1 failed: {words}; this rank's 2 completed step(s) are in "
        f"{out}.rank0, marked incomplete",
        f"fpaudit: error: {words}; this rank's 2 completed step(s) are in {out}.rank1, "
        "marked incomplete",
    }
    assert PACKAGE not in err and "torch/autograd" not in "\n".join(_ours(err))
    assert not out.exists()  # the ranks cannot meet to write one report: each its own
    for rank in (0, 1):
        own = Report.read(tmp_path / f"report.rank{rank}")
        assert own.ranks == [rank] and list(own.steps["step"]) == [0, 1]
        assert own.meta["complete"] is False
        said = "another rank (rank 1 failed: " if rank == 0 else "rank 1 ("
        assert own.meta["stopped_by"] == f"an error on {said}{words})"


def test_a_rank_that_builds_another_model_is_named(tmp_path: Path) -> None:
    out = tmp_path / "report"
    code, err = Launch(out, "differ", "--steps", "2").wait()
    assert code != 0
    differs = (f"{MODEL}: rank 1's model differs from the other ranks' ([1]: params[0] in this "
               "process with sizes [12, 4] appears not to match sizes of the same param in "
               "process 0.); every rank must build the same model")  # fmt: skip
    lines = _ours(err)
    assert len(lines) == 2 and set(lines) == {
        f"fpaudit: error: rank 1 failed: {differs}",
        f"fpaudit: error: {differs}",
    }
    assert "internal error" not in err and not out.exists()


@pytest.mark.parametrize("how", ["SIGTERM to torchrun", "Ctrl-C"])
def test_a_signal_ends_every_rank_with_one_report(tmp_path: Path, how: str) -> None:
    out, started = tmp_path / "report", tmp_path / "started"
    launch = Launch(out, "slow", "--steps", "400", STARTED=str(started))
    launch.when(started)
    time.sleep(1.0)  # some steps
    if how == "Ctrl-C":  # the terminal's SIGINT goes to every process of the job
        os.killpg(launch.process.pid, signal.SIGINT)
    else:
        launch.process.send_signal(signal.SIGTERM)
    code, err = launch.wait()
    assert code != 0
    name = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    lines = _ours(err)
    assert lines and all(f"interrupted by {name} after" in line for line in lines), lines
    report = Report.read(out)  # one report of both ranks, the same steps, incomplete
    steps = _steps(out)
    assert steps[0] == steps[1] and len(steps[0]) >= 1
    assert report.meta["complete"] is False and report.meta["stopped_by"] == name


def test_a_killed_rank_ends_the_other_within_seconds(tmp_path: Path) -> None:
    out, started, kill = tmp_path / "report", tmp_path / "started", tmp_path / "kill"
    launch = Launch(out, "slow", "--steps", "400", STARTED=str(started), KILL=str(kill))
    launch.when(started)
    time.sleep(1.0)
    kill.touch()
    killed_at = time.monotonic()
    code, err = launch.wait()
    assert code != 0 and time.monotonic() - killed_at < 60
    (line,) = _ours(err)
    assert line.startswith(
        "fpaudit: error: another rank's process ended without a word (killed, or it "
        "crashed); rank 0 stopped: Connection closed by peer"
    ), line
    assert line.endswith(f"are in {out}.rank0, marked incomplete") and PACKAGE not in err
    own = Report.read(tmp_path / "report.rank0")
    assert own.meta["complete"] is False and len(own.steps) >= 1
