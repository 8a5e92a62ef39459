"""`fpaudit run` is invisible to the script it audits.

Each script of the zoo (tests/scripts/transparency/) runs twice with the same seed:
plainly (as ``python SCRIPT`` runs it: ``__main__``, its folder on ``sys.path``) and
under ``fpaudit run``. The final weights (the bytes each script writes where
FPAUDIT_TRANSPARENCY_OUT says), the script's stdout and the exit status must be
identical; fpaudit's own summary follows the script's output. Both runs are made in
this process (a fresh interpreter costs ~15 s per run on a loaded 2-core machine);
one test runs a script through a real ``python -m fpaudit run`` process as well.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, one_error_line

ZOO = Path(__file__).resolve().parents[1] / "scripts" / "transparency"
SCRIPTS = sorted(p.name for p in ZOO.glob("[a-z]*.py"))


def mark(script: Path, label: str) -> int:
    """The line of ``script`` that ends with ``# mark: LABEL``."""
    lines = script.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# mark: {label}"))


def _plain(
    script: Path, weights: Path, capsys: pytest.CaptureFixture[str], saves: Path
) -> tuple[int, str, str]:
    """Run ``script`` as ``python script`` would, in this process: exit status, stdout,
    stderr (with what Python prints for ``sys.exit("text")``)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))
    os.environ["FPAUDIT_TRANSPARENCY_OUT"] = str(weights)
    os.environ["FPAUDIT_TRANSPARENCY_SAVES"] = str(saves)
    capsys.readouterr()
    code, told, shown = 0, "", list[str]()
    try:
        with _warnings_to(shown):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        told = "" if done.code is None or isinstance(done.code, int) else f"{done.code}\n"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        del os.environ["FPAUDIT_TRANSPARENCY_OUT"], os.environ["FPAUDIT_TRANSPARENCY_SAVES"]
    captured = capsys.readouterr()
    return code, captured.out, "".join(shown) + captured.err + told


# What fpaudit may add to a script's stderr, after the script ended: one note on what a
# compiled backward left uncounted (docs/commands/run.md). torch.compile's warning about
# global module hooks is the script's own only (fpaudit's are overlooked), so it is not
# among them.
_NOTE = "fpaudit: note: "


@contextmanager
def _warnings_to(told: list[str]) -> Iterator[None]:
    """Warnings as Python prints them on stderr, every one (pytest would take them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    told += [warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught]


def _without_fpaudits_line(err: str) -> str:
    """``err`` without fpaudit's one documented line (at most one: a second stays)."""
    lines = err.splitlines(keepends=True)
    notes = [i for i, line in enumerate(lines) if line.startswith(_NOTE)]
    if notes:
        del lines[notes[0]]
    return "".join(lines)


plain_stderr: dict[str, str] = {}  # each zoo script's stderr in its last plain run

# how each zoo script ends under plain python (the rest end with status 0)
EXITS = {"exit_status.py": 3, "exit_message.py": 1}

# fpaudit run's options per zoo script (default: none): the scripts that save their
# model, copy it or evaluate between steps run with every step captured, so that a
# capture is open (or armed) whenever they do
OPTIONS = {
    name: ("--capture-every", "1")
    for name in ("word_language_model.py", "checkpoint_resume.py", "lbfgs.py", "nanogpt_like.py")
}


def _fabric_names_and_clipping(report: Any) -> None:
    # the model Fabric wraps (_FabricModule) is named as the script's own model, and
    # clip_gradients(clip_val=0.25) is clipping by value, recorded per step
    assert report.meta["modules"][1:] == ["", "0", "1", "2"]
    assert not any("_forward_module" in name for name in report.meta["modules"])
    assert list(report.steps["clip_value"]) == [0.25] * 6
    assert report.steps["clipped_fraction"].between(0, 1).all()


def _lbfgs_losses(report: Any) -> None:
    # each step's loss is what LBFGS.step returned (printed by the script with 6 digits)
    assert [f"{loss:.6f}" for loss in report.steps["loss"]] == _printed_losses
    assert report.steps["grad_amax"].notna().all()  # measured on every (captured) step


_printed_losses: list[str] = []

# what a zoo script's report must show besides the same run (its name -> a check)
REPORT_CHECKS = {"fabric_clip_value.py": _fabric_names_and_clipping, "lbfgs.py": _lbfgs_losses}


def saved_files(folder: Path) -> dict[str, Any]:
    """Every file a zoo script saved (FPAUDIT_TRANSPARENCY_SAVES), by name, as what
    ``torch.load`` gives, made comparable (:func:`comparable`). Both runs of a test share
    this process, where torch.save's bytes differ between two saves of the same object
    (a per-process serialization id, pickle's memo of strings an earlier run made), so
    the bytes are compared in real processes
    (``test_a_real_fpaudit_run_process_leaves_stderr_and_status_alone``)."""
    import torch

    if not folder.exists():
        return {}
    return {p.name: comparable(torch.load(p, weights_only=False)) for p in sorted(folder.glob("*"))}


def comparable(value: Any) -> Any:
    """``value`` as plain data: a tensor as its dtype, shape and bytes; a module as its
    class, its attributes (hooks and all) and its children and tensors, recursively."""
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return ("tensor", str(value.dtype), tuple(value.shape), flat.numpy().tobytes())
    if isinstance(value, torch.nn.Module):
        return ("module", type(value).__qualname__, comparable(vars(value)))
    if isinstance(value, dict):
        return {key: comparable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [comparable(item) for item in value]
    if isinstance(value, weakref.ref):  # (an RNN's _flat_weight_refs): equal by identity
        return ("weakref", value() is None)
    return value


@pytest.fixture
def twice(cli, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run a zoo script plainly and under `fpaudit run`; both outcomes."""

    def go(
        name: str, *options: str
    ) -> tuple[tuple[int, str, bytes], tuple[int, str, str, bytes], Path]:
        script = ZOO / name
        plain_weights, watched_weights = tmp_path / "plain.bin", tmp_path / "watched.bin"
        plain_saves = tmp_path / "plain-saves"
        plain_code, plain_out, plain_err = _plain(script, plain_weights, capsys, plain_saves)
        plain_stderr[name] = plain_err
        monkeypatch.setenv("FPAUDIT_TRANSPARENCY_OUT", str(watched_weights))
        monkeypatch.setenv("FPAUDIT_TRANSPARENCY_SAVES", str(tmp_path / "watched-saves"))
        out = tmp_path / "report"
        shown: list[str] = []
        with _warnings_to(shown):
            result = cli("run", *options, "--out", out, "--", script)
        monkeypatch.delenv("FPAUDIT_TRANSPARENCY_OUT")
        monkeypatch.delenv("FPAUDIT_TRANSPARENCY_SAVES")
        err = "".join(shown) + result.stderr
        return (
            (plain_code, plain_out, plain_weights.read_bytes()),
            (result.code, result.stdout, err, watched_weights.read_bytes()),
            out,
        )

    return go


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_runs_the_same_with_and_without_fpaudit(twice, name: str, tmp_path: Path) -> None:
    if name.startswith("fabric"):
        pytest.importorskip("lightning.fabric")
    (plain_code, plain_out, plain_weights), (code, out, err, weights), report = twice(
        name, *OPTIONS.get(name, ())
    )
    # every file the script saved (torch.save of the whole module included), bit for bit
    assert saved_files(tmp_path / "watched-saves") == saved_files(tmp_path / "plain-saves")
    assert plain_code == EXITS.get(name, 0)
    assert code == plain_code, err  # sys.exit(n), sys.exit("text"): the script's own status
    assert "Traceback" not in err and "error" not in err, err
    assert _without_fpaudits_line(err) == plain_stderr[name]  # sys.exit("text") prints it
    assert weights == plain_weights  # final weights, bit for bit
    assert plain_out.count("\n") >= 5  # the script printed its steps
    assert out.startswith(plain_out)  # the script's stdout, unchanged, then fpaudit's summary
    assert out[len(plain_out) :].startswith(f"Ran {ZOO / name}: ")
    from fpaudit.report.store import Report

    # one printed line per optimizer step: fpaudit counted the same steps
    printed = [line for line in plain_out.splitlines() if line.startswith("step ")]
    read = Report.read(report)  # written before fpaudit exits as the script did
    assert read.meta["steps_run"] == len(printed)
    assert read.meta["complete"] is (code == 0)  # a non-zero exit ends the run early
    assert (read.meta["stopped_by"] == "script exit") is (code != 0)
    if name in REPORT_CHECKS:
        _printed_losses[:] = [line.split()[3] for line in printed]
        REPORT_CHECKS[name](read)


def test_block_statistics_leave_the_script_alone(twice) -> None:
    # --recipe quantizes every captured tensor (a copy, on the side): the weights the
    # script trains are bit for bit those of the plain run, on every step captured
    from fpaudit.report.store import Report

    (plain_code, plain_out, plain_weights), (code, out, err, weights), report = twice(
        "adamw_groups.py", "--recipe", "mxfp8-e4m3", "--recipe", "nvfp4", "--capture-every", "1"
    )
    assert code == plain_code == 0, err
    assert weights == plain_weights
    assert out.startswith(plain_out)
    read = Report.read(report)
    assert read.recipes == ["mxfp8-e4m3", "nvfp4"] and read.blocks is not None
    assert set(read.blocks["step"]) == set(range(read.meta["steps_run"]))  # every step


def test_a_live_tensorboard_dashboard_leaves_the_script_alone(twice, tmp_path: Path) -> None:
    # --tensorboard: each captured step's metrics and histograms are written inside the
    # script's step (after the capture closes); the weights stay bit for bit the plain run's
    pytest.importorskip("tensorboard")
    board = tmp_path / "tb"
    (plain_code, plain_out, plain_weights), (code, out, err, weights), _ = twice(
        "adamw_groups.py", "--capture-every", "1", "--tensorboard", str(board)
    )
    assert code == plain_code == 0, err
    assert weights == plain_weights
    assert out.startswith(plain_out)
    assert _without_fpaudits_line(err) == plain_stderr["adamw_groups.py"]
    assert list(board.glob("events.out.tfevents.*"))


def test_keyword_calls_are_judged_at_their_lines(twice) -> None:
    from fpaudit.report.store import Report

    script = ZOO / "keywords_misuse.py"
    _, (code, _out, err, _), path = twice(script.name)
    assert code == 0, err
    found = {f["code"]: f for f in Report.read(path).meta["findings"]}
    assert set(found) == {"clip-before-unscale", "grad-read-while-scaled"}, found
    clips = [f for f in Report.read(path).meta["findings"] if f["code"] == "clip-before-unscale"]
    assert sorted((f["file"], f["line"]) for f in clips) == sorted(
        (str(script), mark(script, name)) for name in ("norm", "value", "parts")
    )
    reads = [f for f in Report.read(path).meta["findings"] if f["code"] == "grad-read-while-scaled"]
    assert sorted((f["file"], f["line"]) for f in reads) == sorted(
        (str(script), mark(script, name)) for name in ("grads", "read")
    )
    # 6 steps, each with the same mistakes: every one counted
    assert all(f["count"] == 6 for f in clips + reads)


def test_the_correct_keyword_loop_has_no_findings(twice) -> None:
    from fpaudit.report.store import Report

    _, (code, _, err, _), path = twice("keywords.py")
    assert code == 0, err
    assert Report.read(path).meta["findings"] == []


def test_a_bug_in_fpaudit_is_reported_as_fpaudits(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import contextmanager

    from fpaudit.run.training import TrainingMonitor

    @contextmanager
    def broken(self, call):
        raise KeyError("oops")
        yield

    monkeypatch.setattr(TrainingMonitor, "on_scale", broken)
    monkeypatch.setenv("FPAUDIT_TRANSPARENCY_OUT", str(tmp_path / "w.bin"))
    line = one_error_line(cli("run", "--out", tmp_path / "r", "--", ZOO / "accumulation.py"))
    assert "internal error" in line and "fpaudit's training monitor failed" in line
    assert "not in accumulation.py" in line and "the script raised" not in line


@pytest.mark.slow
@pytest.mark.parametrize("name", ["compiled.py", "exit_message.py", "word_language_model.py"])
def test_a_real_fpaudit_run_process_leaves_stderr_and_status_alone(
    tmp_path: Path, name: str
) -> None:
    # in real processes: Dynamo's own warnings are printed as Python prints them,
    # sys.exit("text") prints by Python, and torch.save's bytes are comparable
    # (a whole module saved each epoch under --capture-every 1, word_language_model.py)
    script = ZOO / name
    runs = []
    for command, folder in (
        ([], "plain"),
        (["-m", "fpaudit", "run", "--capture-every", "1", "--out", tmp_path / "r", "--"], "run"),
    ):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FPAUDIT_TRANSPARENCY_OUT": "",
               "FPAUDIT_TRANSPARENCY_SAVES": str(tmp_path / folder)}  # fmt: skip
        runs.append(
            subprocess.run(
                [sys.executable, *command, script],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
                cwd=tmp_path,
            )
        )
    plain, watched = runs
    assert watched.returncode == plain.returncode == EXITS.get(name, 0), watched.stderr
    assert _without_fpaudits_line(watched.stderr) == plain.stderr
    assert watched.stdout.startswith(plain.stdout) and plain.stdout
    saved = sorted(p.name for p in (tmp_path / "plain").glob("*"))
    assert saved == sorted(p.name for p in (tmp_path / "run").glob("*"))
    for file in saved:  # every saved file, bit for bit
        assert (tmp_path / "run" / file).read_bytes() == (tmp_path / "plain" / file).read_bytes()
    if name == "word_language_model.py":
        # the module saved under fpaudit loads where fpaudit cannot be imported
        load = (
            "import sys; sys.modules['fpaudit'] = None\n"
            "import torch\n"
            f"model = torch.load({str(tmp_path / 'run' / 'model-1.pt')!r}, weights_only=False)\n"
            "hooks = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]\n"
            "print(type(model).__name__, len(hooks))\n"
        )
        loaded = subprocess.run(
            [sys.executable, "-c", load],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ZOO)},
            timeout=120,
            cwd=tmp_path,
        )
        assert loaded.returncode == 0, loaded.stderr
        assert loaded.stdout == "RNNModel 0\n"


@pytest.mark.slow
def test_a_real_fpaudit_run_process_leaves_stdout_and_status_alone(tmp_path: Path) -> None:
    script = ZOO / "gan.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FPAUDIT_TRANSPARENCY_OUT": ""}
    plain = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, env=env, timeout=300
    )
    watched = subprocess.run(
        [sys.executable, "-m", "fpaudit", "run", "--out", tmp_path / "r", "--", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert plain.returncode == watched.returncode == 0, watched.stderr
    assert watched.stdout.startswith(plain.stdout) and plain.stdout


def test_a_bug_in_fpaudits_backward_capture_is_reported_as_fpaudits(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the capture's dispatch mode runs inside the script's backward: its errors are
    # fpaudit's, the op's own (below) the script's
    from fpaudit.capture import mode as capture

    def broken(self, func):
        raise ZeroDivisionError("a bug in the capture")

    monkeypatch.setattr(capture.BackwardMode, "_op_name", broken)
    monkeypatch.setenv("FPAUDIT_TRANSPARENCY_OUT", str(tmp_path / "w.bin"))
    script = ZOO / "keywords.py"
    result = cli("run", "--capture-every", "1", "--out", tmp_path / "r", "--", script)
    line = one_error_line(result)  # exit 2, as every internal error
    assert "internal error" in line and "fpaudit's training monitor failed" in line
    assert "ZeroDivisionError: a bug in the capture" in line
    assert f"at {script}:{mark(script, 'backward')}" in line
    assert "not in keywords.py" in line and "the script raised" not in line


def test_an_op_that_fails_in_the_scripts_backward_is_the_scripts_error(cli, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "class Bad(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x):\n"
        "        return x * 2\n"
        "    @staticmethod\n"
        "    def backward(ctx, grad):\n"
        "        return grad @ torch.ones(5, 7)  # a shape error, in an aten op\n"
        "model = torch.nn.Linear(3, 4)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    optimizer.zero_grad()\n"
        "    out = model(torch.randn(2, 3))\n"
        "    loss = (Bad.apply(out) if step == 2 else out).sum()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
    )
    result = cli("run", "--capture-every", "1", "--out", tmp_path / "r", "--", script)
    line = one_error_line(result)
    # torch's own message, as this release words it ("mm: mat1 and mat2 shapes ..." from 2.15)
    assert f"{script}:8: the script raised RuntimeError: " in line, line
    assert "mat1 and mat2 shapes cannot be multiplied (2x4 and 5x7)" in line, line
    assert "internal error" not in line and "monitor" not in line
