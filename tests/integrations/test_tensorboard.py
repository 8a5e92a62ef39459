"""TensorBoard export, read back with tensorboard's own event reader (no mocks).

The report is tests/rules/test_metrics.py's probe (3 steps of values known by hand);
its numbers are derived there. Scalars are stored as float32 in event files.
"""

from __future__ import annotations

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
        ("fpaudit/fp16/underflow/probe", 0),
    ):
        scalars = read.Scalars(tag)
        assert [s.step for s in scalars] == [0, 1, 2], tag
        assert [s.value for s in scalars] == [np.float32(row[column]) for row in EXPECTED], tag
    assert [s.value for s in read.Scalars("fpaudit/skipped_steps")] == [0.0, 0.0, 0.0]
    histograms = read.Histograms("fpaudit/backward/probe")
    assert [h.step for h in histograms] == [0, 1, 2]
    first = histograms[0].histogram_value
    # step 0: 2**-26, 2**-25, 2**-24 and 0.5: binades -26, -25, -24, -1, upper edges 2**(b+1)
    assert list(first.bucket_limit) == [2.0**-25, 2.0**-24, 2.0**-23, 1.0]
    assert list(first.bucket) == [1, 1, 1, 1] and first.num == 4
    # step 2: 70000 (binade 16) and three 1.0s (binade 0)
    assert list(histograms[2].histogram_value.bucket_limit) == [2.0, 2.0**17]
    assert list(histograms[2].histogram_value.bucket) == [3, 1]


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


# -- Lightning's loggers: the callback logs each audited step's metrics -----------------
def _fit_with_loggers(tmp_path: Path, **callback_options: Any) -> tuple[Report, Path, Path]:
    import warnings

    L = pytest.importorskip("lightning")
    import torch
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from torch import nn

    from fpaudit.integrations.lightning import FpauditCallback
    from fpaudit.report.store import Report

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
    csv = CSVLogger(tmp_path / "csv", name="", version="")
    board = TensorBoardLogger(tmp_path / "tb", name="", version="")
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", logger=[csv, board], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        callbacks=[FpauditCallback(out=tmp_path / "report", every=2, **callback_options)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    return Report.read(tmp_path / "report"), Path(csv.log_dir), Path(board.log_dir)


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
    per_module = [c for c in logged.columns if c.startswith("fpaudit/fp16/underflow/")]
    assert len(per_module) == 2


def test_lightning_metrics_logging_is_one_argument_off(tmp_path: Path) -> None:
    _, csv_dir, _ = _fit_with_loggers(tmp_path, log_metrics=False)
    metrics_file = csv_dir / "metrics.csv"
    assert not metrics_file.exists() or "fpaudit/" not in metrics_file.read_text()
