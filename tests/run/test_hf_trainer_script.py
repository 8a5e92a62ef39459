"""A Hugging Face ``Trainer`` script (tests/scripts/hf_trainer.py) runs the same under
``fpaudit run`` as under plain ``python``: stdout, stderr (fpaudit's one documented line
aside), exit status and every file the Trainer writes (two checkpoints with their
optimizer, scheduler, RNG states and ``trainer_state.json``, the final model and
config), bit for bit.

Both runs are real processes (the Trainer's loggers bind stderr once per process, and
``logger.warning_once`` prints once per process) and write to the same output folder,
moved aside between them, so that the paths ``training_args.bin`` pickles are equal.
Two narrow normalisations, both of the clock, never of what the script computes:

* stdout: the values of the Trainer's closing timings (``train_runtime``,
  ``train_samples_per_second``, ``train_steps_per_second``) are wall-clock times;
* stderr: torch's log lines start with the time and the process id
  (``W1207 23:54:11.840000 8922 torch/...``: torchao's import warns so, where installed).

Hugging Face's progress bars (``Writing model shards ... it/s``, times again) are
turned off in both runs with ``HF_HUB_DISABLE_PROGRESS_BARS=1``, an environment
variable, the script unchanged. Every saved file is compared without normalisation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT
from .test_transparency import _without_fpaudits_line

SCRIPT = ROOT / "tests" / "scripts" / "hf_trainer.py"

_TIMINGS = re.compile(
    r"'(train_runtime|train_samples_per_second|train_steps_per_second)': '[0-9.e+-]+'"
)
_TORCH_LOG_CLOCK = re.compile(r"^([DIWEC])\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ ", re.MULTILINE)


def _without_clock(text: str) -> str:
    text = _TIMINGS.sub(r"'\1': '<time>'", text)
    return _TORCH_LOG_CLOCK.sub(r"\1<time> <pid> ", text)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_the_normalisations_touch_only_the_clock() -> None:
    # a hand-written line of each kind: the numbers the script computed stay
    printed = (
        "{'train_runtime': '5.013', 'train_samples_per_second': '6.384', 'train_loss': '4.162'}\n"
    )
    assert _without_clock(printed) == (
        "{'train_runtime': '<time>', 'train_samples_per_second': '<time>', 'train_loss': '4.162'}\n"
    )
    logged = "W1207 23:54:11.840000 8922 torch/utils/_pytree.py:630] <enum 'K'> is ...\n"
    assert _without_clock(logged) == "W<time> <pid> torch/utils/_pytree.py:630] <enum 'K'> is ...\n"
    assert _without_clock("loss 4.162 at W1207\n") == "loss 4.162 at W1207\n"


@pytest.mark.slow
def test_a_hugging_face_trainer_script_runs_the_same_under_fpaudit(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the dev extra installs transformers")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (the dev extra)")
    from fpaudit.kernels import build
    from fpaudit.report.store import Report

    if build.mode() != "torch":  # built (once per environment) before: its line is no run's
        build.cpu_kernel()
    output_dir, report = tmp_path / "trainer", tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    runs, saved = [], []
    for command in ([], ["-m", "fpaudit", "run", "--capture-every", "1", "--out", report, "--"]):
        runs.append(
            subprocess.run(
                [sys.executable, *command, SCRIPT, output_dir],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                cwd=tmp_path,
            )
        )
        saved.append(_files(output_dir))
        output_dir.rename(tmp_path / f"trainer-{len(runs)}")
    plain, watched = runs
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert _without_clock(_without_fpaudits_line(watched.stderr)) == _without_clock(plain.stderr)
    plain_out, watched_out = _without_clock(plain.stdout), _without_clock(watched.stdout)
    assert watched_out.startswith(plain_out)  # then fpaudit's summary
    assert watched_out[len(plain_out) :].startswith(f"Ran {SCRIPT}: ")
    # two checkpoints and the final model: every file, bit for bit
    assert {"checkpoint-2/optimizer.pt", "checkpoint-4/rng_state.pth"} <= set(saved[0])
    assert {"model.safetensors", "checkpoint-4/trainer_state.json"} <= set(saved[0])
    assert saved[1] == saved[0]

    # fpaudit saw the Trainer's loop as it is: one step per optimizer update, two
    # backward passes each (gradient_accumulation_steps=2), clipping at max_grad_norm
    # 1.0, and the pre-clip norm the Trainer logged (4 significant digits, as printed)
    logged = re.findall(r"'grad_norm': '([^']+)'", plain.stdout)
    steps = Report.read(report).steps
    assert len(logged) == len(steps) == 4
    assert list(steps["backward_calls"]) == [2] * 4
    assert list(steps["clip_max_norm"]) == [1.0] * 4
    assert [f"{norm:.4g}" for norm in steps["grad_norm"]] == logged
