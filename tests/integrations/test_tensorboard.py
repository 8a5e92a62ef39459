"""TensorBoard export, read back with tensorboard's own event reader (no mocks).

The report is tests/rules/test_metrics.py's probe (3 steps of values known by hand);
its numbers are derived there. Scalars are stored as float32 in event files.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fpaudit.report.store import Report
from tests.conftest import one_error_line
from tests.rules.test_metrics import EXPECTED, audited

pytest.importorskip("tensorboard")


def events(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


@pytest.fixture
def report_dir(tmp_path: Path) -> Path:
    out = tmp_path / "report"
    audited().write(out)
    return out


def test_export_writes_every_steps_metrics_and_histograms(
    cli, report_dir: Path, tmp_path: Path
) -> None:
    done = cli("export", report_dir, "--tensorboard", tmp_path / "tb", "--top", 1)
    assert done.code == 0, done.stderr
    assert done.stdout.strip() == f"Wrote 3 step(s) of fpaudit metrics (fp16) to {tmp_path / 'tb'}"
    read = events(tmp_path / "tb")
    for tag, column in (
        ("fpaudit/fp16/underflow", 0),
        ("fpaudit/fp16/underflow_at_recommended", 1),
        ("fpaudit/fp16/overflow", 2),
        ("fpaudit/fp16/recommended_log2_scale", 3),
        ("fpaudit/fp16/module_underflow/probe", 0),
    ):
        scalars = read.Scalars(tag)
        assert [s.step for s in scalars] == [0, 1, 2], tag
        assert [s.value for s in scalars] == [np.float32(row[column]) for row in EXPECTED], tag
    assert [s.value for s in read.Scalars("fpaudit/skipped_steps")] == [0.0, 0.0, 0.0]
    histograms = read.Histograms("fpaudit/backward/probe")
    assert [h.step for h in histograms] == [0, 1, 2]
    first = histograms[0].histogram_value
    # step 0: 2**-26, 2**-25, 2**-24 and 0.5: binades -26, -25, -24, -1, upper edges 2**(b+1),
    # and every binade between them (-23 .. -2) empty: 26 buckets
    assert list(first.bucket_limit) == [2.0**e for e in range(-25, 1)]
    assert list(first.bucket) == [1, 1, 1] + [0] * 22 + [1] and first.num == 4
    # step 2: 70000 (binade 16) and three 1.0s (binade 0), 15 empty binades between
    assert list(histograms[2].histogram_value.bucket_limit) == [2.0**e for e in range(1, 18)]
    assert list(histograms[2].histogram_value.bucket) == [3] + [0] * 15 + [1]


def test_tensorboards_own_reading_draws_each_count_inside_its_binade(
    cli, report_dir: Path, tmp_path: Path
) -> None:
    """TensorBoard's ``data_compat`` turns each histogram into [left, right, count] buckets,
    bucket i from limit i-1 to limit i: every count must be drawn over the binade its
    values are in (the probe's values, by hand in tests/rules/test_metrics.py's STEPS)."""
    from tensorboard import data_compat
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    from tests.rules.test_metrics import STEPS

    assert cli("export", report_dir, "--tensorboard", tmp_path / "tb", "--top", 1).code == 0
    drawn: dict[int, np.ndarray] = {}
    for path in sorted((tmp_path / "tb").glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():
            event = event_pb2.Event.FromString(record)  # as written: old-style histograms
            for value in event.summary.value:
                if value.HasField("histo") and value.tag == "fpaudit/backward/probe":
                    migrated = data_compat.migrate_value(value)
                    drawn[event.step] = tensor_util.make_ndarray(migrated.tensor)
    assert sorted(drawn) == [0, 1, 2]
    for step, buckets in drawn.items():
        values = [abs(v) for v in STEPS[step] if v != 0]
        for left, right, count in buckets:
            assert right == 2 * left, (step, left, right)  # one binade, never across a gap
            inside = sum(1 for v in values if left <= v < right)
            assert count == inside, (step, left, right, count, values)
        assert buckets[:, 2].sum() == len(values)


def test_export_needs_a_directory_and_names_a_bad_one(
    cli, report_dir: Path, tmp_path: Path
) -> None:
    assert (
        one_error_line(cli("export", report_dir))
        == "fpaudit: error: export needs --tensorboard DIR"
    )
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    line = one_error_line(cli("export", report_dir, "--tensorboard", blocker / "tb"))
    assert line.startswith(
        f"fpaudit: error: cannot write TensorBoard event files to {blocker / 'tb'} ("
    )
    line = one_error_line(cli("export", tmp_path / "nope", "--tensorboard", tmp_path / "tb"))
    assert "nope" in line


def test_without_the_tensorboard_package_export_says_how_to_install_it(
    cli, report_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    line = one_error_line(cli("export", report_dir, "--tensorboard", tmp_path / "tb"))
    assert line.endswith("pip install 'fpaudit[tensorboard]'")
    assert not (tmp_path / "tb").exists()


# -- scan and run --tensorboard: written as the run goes ---------------------------------
def contents(directory: Path) -> dict[str, Any]:
    """Every scalar and histogram in ``directory``'s event files, by tag: (step, value) and
    (step, bucket limits, counts)."""
    read = events(directory)
    tags = read.Tags()
    scalars = {t: [(s.step, s.value) for s in read.Scalars(t)] for t in tags["scalars"]}
    histograms = {
        t: [
            (h.step, list(h.histogram_value.bucket_limit), list(h.histogram_value.bucket))
            for h in read.Histograms(t)
        ]
        for t in tags["histograms"]
    }
    return {"scalars": scalars, "histograms": histograms}


def report_bins(report: Report, module: str, step: int) -> dict[float, int]:
    """Count of ``module``'s nonzero finite backward values per binade upper edge at
    ``step``, straight from the report's tables (records joined with bins), unscaled: a
    value that scales with the loss is shifted down by its record's log2 loss scale."""
    records = report.records
    mine = records[
        (records["module"] == module) & (records["kind"] == "backward") & (records["step"] == step)
    ]
    counts: dict[float, int] = {}
    for row in report.bins.merge(mine, on="record_id").itertuples():
        shift = int(np.log2(row.loss_scale)) if row.scales_with_loss else 0
        edge = 2.0 ** (int(row.binade) - shift + 1)
        counts[edge] = counts.get(edge, 0) + int(row.count)
    return counts


def test_scan_writes_each_captured_step_as_export_writes_the_report(cli, tmp_path: Path) -> None:
    board, report_dir = tmp_path / "live", tmp_path / "report"
    done = cli(
        "scan", "sample_configs/mlp.py", "--steps", 4, "--every", 2, "--loss-scale", "1024",
        "--out", report_dir, "--tensorboard", board,
    )  # fmt: skip
    assert done.code == 0, done.stderr
    assert cli("export", report_dir, "--tensorboard", tmp_path / "after").code == 0
    live, after = contents(board), contents(tmp_path / "after")
    assert live == after  # every tag, step, value and bucket
    assert [step for step, _ in live["scalars"]["fpaudit/fp16/underflow"]] == [0, 2]
    assert live["scalars"]["fpaudit/loss_scale_log2"] == [(0, 10.0), (2, 10.0)]
    report = Report.read(report_dir)
    assert live["histograms"]
    for tag, series in live["histograms"].items():
        module = tag.removeprefix("fpaudit/backward/")
        for step, limits, counts in series:
            drawn = {limit: n for limit, n in zip(limits, counts, strict=True) if n}
            assert drawn == report_bins(report, module, step)
            # the empty binades between the nonzero ones are kept: one bucket per binade
            assert all(b == 2 * a for a, b in itertools.pairwise(limits))


def test_the_live_writer_writes_each_step_before_the_next_begins(tmp_path: Path) -> None:
    from fpaudit.integrations.tensorboard import LiveWriter
    from fpaudit.run.scan import ScanOptions, scan

    live = LiveWriter(tmp_path / "tb", "fp16", top=2)
    seen: list[list[int]] = []

    def after_step(audit: Any) -> None:
        live.write_step(audit)
        seen.append([s.step for s in events(tmp_path / "tb").Scalars("fpaudit/fp16/underflow")])

    report = scan("sample_configs/mlp.py", ScanOptions(steps=3), on_captured=after_step)
    live.close()
    assert seen == [[0], [0, 1], [0, 1, 2]]  # on disk while the scan was still running
    assert live.steps_written == 3 and report.info.steps_run == 3


def test_a_dashboard_that_fails_mid_run_is_one_warning_and_the_report_is_whole(
    tmp_path: Path,
) -> None:
    from fpaudit.integrations.tensorboard import LiveWriter
    from fpaudit.run.scan import ScanOptions, scan

    told: list[str] = []
    board = tmp_path / "tb"
    live = LiveWriter(board, "fp16", warn=told.append)  # checked and made: writable now
    board.rmdir()
    board.write_text("a file where the event files were to go")  # the writer cannot open
    report = scan("sample_configs/mlp.py", ScanOptions(steps=3), on_captured=live.write_step)
    live.close()
    assert len(told) == 1 and told[0].startswith(f"writing TensorBoard event files to {board}")
    assert told[0].endswith("the audit goes on without them")
    assert report.info.steps_run == 3 and list(report.steps["step"]) == [0, 1, 2]
    assert live.steps_written == 0


def test_run_writes_its_captured_steps_and_the_skips_once_it_ends(cli, tmp_path: Path) -> None:
    board, report_dir = tmp_path / "live", tmp_path / "run"
    done = cli(
        "run", "--capture-every", 5, "--out", report_dir, "--tensorboard", board, "--",
        "sample_configs/train_loop.py", "--steps", 20, "--bugs",
    )  # fmt: skip
    assert done.code == 0, done.stderr
    assert cli("export", report_dir, "--tensorboard", tmp_path / "after").code == 0
    live, after = contents(board), contents(tmp_path / "after")
    assert live == after
    skipped = live["scalars"]["fpaudit/skipped_steps"]
    # every 5th step, and 11: the step after the skip at 10, past calibration (issue 54)
    assert [step for step, _ in skipped] == [0, 5, 10, 11, 15]
    report = Report.read(report_dir)
    steps = report.steps.sort_values("step")
    # skips so far at each captured step, counted from the run's own steps table
    expected = [float(steps[steps["step"] <= s]["skipped"].sum()) for s in (0, 5, 10, 11, 15)]
    assert [value for _, value in skipped] == expected and expected[-1] > 0  # --bugs skips
    by_origin = [live["scalars"][f"fpaudit/skips_{o}"] for o in ("calibration", "backward")]
    assert [[v for _, v in series] for series in by_origin] == [
        [1.0, 6.0, 7.0, 7.0, 7.0],  # calibration: steps 0 to 6 (6 of them by step 5)
        [0.0, 0.0, 1.0, 1.0, 1.0],  # the overflow at step 10
    ]  # fmt: skip


def test_scan_and_run_name_a_bad_dashboard_directory_before_running(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    bad = ("--tensorboard", blocker / "tb")
    scan = cli("scan", "sample_configs/mlp.py", "--out", tmp_path / "r1", *bad)
    run = cli("run", "--out", tmp_path / "r2", *bad, "--", "sample_configs/train_loop.py")
    for done in (scan, run):
        assert one_error_line(done).startswith(
            f"fpaudit: error: cannot write TensorBoard event files to {blocker / 'tb'} ("
        )
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()  # nothing ran
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    missing = ("--tensorboard", tmp_path / "tb")
    line = one_error_line(cli("scan", "sample_configs/mlp.py", "--out", tmp_path / "r3", *missing))
    assert line.endswith("pip install 'fpaudit[tensorboard]'")
    assert not (tmp_path / "tb").exists() and not (tmp_path / "r3").exists()


# -- Lightning's loggers: the callback logs each audited step's metrics -----------------
def fit_tiny(tmp_path: Path, loggers: list[Any], **callback_options: Any) -> Report:
    """4 Lightning steps of a tiny regression (a loss of about 2**-40: fp16 loses values),
    audited every 2nd step with ``loggers``; the report."""
    import warnings

    L = pytest.importorskip("lightning")
    import torch
    from torch import nn

    from fpaudit.integrations.lightning import FpauditCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x) * 2.0**-20, y * 2.0**-20)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", logger=loggers, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        callbacks=[FpauditCallback(out=tmp_path / "report", every=2, **callback_options)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    return Report.read(tmp_path / "report")


def _fit_with_loggers(tmp_path: Path, **callback_options: Any) -> tuple[Report, Path, Path]:
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    csv = CSVLogger(tmp_path / "csv", name="", version="")
    board = TensorBoardLogger(tmp_path / "tb", name="", version="")
    report = fit_tiny(tmp_path, [csv, board], **callback_options)
    return report, Path(csv.log_dir), Path(board.log_dir)


def test_lightning_logs_each_audited_steps_metrics_to_csv_and_tensorboard(tmp_path: Path) -> None:
    import pandas as pd

    from fpaudit.rules.metrics import step_metrics

    report, csv_dir, board_dir = _fit_with_loggers(tmp_path, metrics_top=2)
    # audited steps 0 and 2 (every=2); the live per-module series are the first step's
    # worst 2 modules, the report's whole-run worst 2 may differ: compare the run-level ones
    first = step_metrics(report, "fp16", top=0)
    assert [m.step for m in first] == [0, 2]
    logged = pd.read_csv(csv_dir / "metrics.csv")
    read = events(board_dir)
    for name in ("fpaudit/fp16/underflow", "fpaudit/fp16/recommended_log2_scale"):
        expected = [m.values[name] for m in first]
        rows = logged.dropna(subset=[name])
        assert rows["step"].tolist() == [0, 2] and rows[name].tolist() == expected, name
        board = read.Scalars(name)
        assert [(s.step, s.value) for s in board] == [
            (step, np.float32(value)) for step, value in zip([0, 2], expected, strict=True)
        ]
    assert first[0].values["fpaudit/fp16/underflow"] > 0  # a loss of 2**-40: values to lose
    per_module = [c for c in logged.columns if c.startswith("fpaudit/fp16/module_underflow/")]
    assert len(per_module) == 2


def test_lightning_metrics_logging_is_one_argument_off(tmp_path: Path) -> None:
    _, csv_dir, _ = _fit_with_loggers(tmp_path, log_metrics=False)
    metrics_file = csv_dir / "metrics.csv"
    assert not metrics_file.exists() or "fpaudit/" not in metrics_file.read_text()


# -- the Hugging Face Trainer: metrics go where report_to sends the Trainer's logs ------
def _hf_board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[Any, Any]:
    """A 4-step HF Trainer run, audited every 2nd step, with report_to=["tensorboard"];
    the Trainer and its event files, read back."""
    from tests.integrations.test_integrations import _gpt2, _train

    # the Trainer's TensorBoardCallback writes here (its own setting, read when it is made)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    _, trainer = _train(
        tmp_path, _gpt2(), report_to=["tensorboard"], max_steps=4, every=2, **options
    )
    return trainer, events(tmp_path / "tb")


def test_huggingface_metrics_reach_report_to_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fpaudit.rules.metrics import step_metrics

    trainer, read = _hf_board(tmp_path, monkeypatch, metrics_top=2)
    report = Report.read(tmp_path / "report")
    expected = step_metrics(report, "fp16", top=0)  # an fp32 run: judged in fp16
    assert [m.step for m in expected] == [0, 2]  # every=2 of 4 optimizer steps
    # logged at the Trainer's own numbering: optimizer step k counted, global_step k + 1,
    # where the Trainer's loss of that step is logged too
    assert [s.step for s in read.Scalars("train/loss")] == [1, 2, 3, 4]
    for name in (
        "fpaudit/fp16/underflow",
        "fpaudit/fp16/overflow",
        "fpaudit/fp16/recommended_log2_scale",
        "fpaudit/loss_scale_log2",
        "fpaudit/skipped_steps",
    ):
        board = [(s.step, s.value) for s in read.Scalars(f"train/{name}")]
        assert board == [(m.step + 1, np.float32(m.values[name])) for m in expected], name
    per_module = [
        t for t in read.Tags()["scalars"] if t.startswith("train/fpaudit/fp16/module_underflow/")
    ]
    assert len(per_module) == 2
    for tag in per_module:  # the first step's worst 2, each at both audited steps
        module = tag.removeprefix("train/fpaudit/fp16/module_underflow/")
        values = step_metrics(report, "fp16", modules=[module])
        name = f"fpaudit/fp16/module_underflow/{module}"
        assert [(s.step, s.value) for s in read.Scalars(tag)] == [
            (m.step + 1, np.float32(m.values[name])) for m in values
        ]
    # sent to the reporters alone: the Trainer's own history (and console) is left as it was
    assert trainer.state.log_history and not [
        key for entry in trainer.state.log_history for key in entry if "fpaudit/" in key
    ]


def test_huggingface_metrics_logging_is_one_argument_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, read = _hf_board(tmp_path, monkeypatch, log_metrics=False)
    assert read.Scalars("train/loss")  # the Trainer's own logs are there
    assert not [t for t in read.Tags()["scalars"] if "fpaudit/" in t]
