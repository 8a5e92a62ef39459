"""Weights & Biases (offline) and MLflow (a local file store) get fpaudit's metrics.

Through Lightning's ``WandbLogger`` and ``MLFlowLogger`` (the callback's
``log_metrics``), and through the Hugging Face Trainer's ``report_to=["mlflow", "wandb"]``.
What was logged is read back from what each library wrote: MLflow with its own client,
W&B from its offline run file, whose records are W&B's own protobuf messages
(``wandb.proto.wandb_internal_pb2.Record``) framed as LevelDB log records (wandb has no
public reader of an offline run). The expected values are the written report's own
(:func:`fpaudit.rules.metrics.step_metrics`), as tests/integrations/test_tensorboard.py
checks them for TensorBoard.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fpaudit.report.store import Report
from fpaudit.rules.metrics import step_metrics
from tests.integrations.test_tensorboard import fit_tiny

pytest.importorskip("lightning")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

RUN_LEVEL = (
    "fpaudit/fp16/underflow",
    "fpaudit/fp16/underflow_at_recommended",
    "fpaudit/fp16/overflow",
    "fpaudit/fp16/recommended_log2_scale",
    "fpaudit/loss_scale_log2",
    "fpaudit/skipped_steps",
)


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline and MLflow on a local file store under ``tmp_path``; its URI's folder."""
    import wandb

    wandb.teardown()  # W&B reads its settings (WANDB_DIR) once per process setup
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # no database server here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "fpaudit")  # HF's MLflowCallback reads it
    import mlflow

    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")  # over an earlier test's
    (tmp_path / "wandb").mkdir()
    yield tmp_path / "mlruns"
    wandb.teardown()


def wandb_history(root: Path) -> list[dict[str, Any]]:
    """The history rows of the one offline W&B run under ``root``, as logged."""
    from wandb.proto import wandb_internal_pb2

    (path,) = root.glob("**/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"  # W&B's header (7 bytes), then LevelDB log records
    block, position, pending, rows = 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header: padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:  # preallocated space
            position += left - 7 - length
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first, middle/last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def mlflow_series(uri: str, name: str) -> dict[str, list[tuple[int, float]]]:
    """Metric ``name`` of every run of experiment ``name`` at ``uri``, by metric key."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
        if key.startswith("fpaudit/")
    }


def test_lightning_logs_fpaudits_metrics_to_wandb_and_mlflow(tmp_path: Path, offline: Path) -> None:
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    board = WandbLogger(save_dir=tmp_path / "wandb", offline=True, project="fpaudit")
    tracker = MLFlowLogger(experiment_name="fpaudit", tracking_uri=f"file:{offline}")
    report = fit_tiny(tmp_path, [board, tracker], metrics_top=2)
    wandb.finish()
    expected = step_metrics(report, "fp16", top=0)
    assert [m.step for m in expected] == [0, 2]
    logged = mlflow_series(f"file:{offline}", "fpaudit")
    for name in RUN_LEVEL:
        assert logged[name] == [(m.step, m.values[name]) for m in expected], name
    modules = [k for k in logged if k.startswith("fpaudit/fp16/module_underflow/")]
    assert len(modules) == 2  # metrics_top=2, each at both audited steps
    assert all(len(logged[k]) == 2 for k in modules)
    rows = [r for r in wandb_history(tmp_path / "wandb") if "fpaudit/fp16/underflow" in r]
    assert [r["trainer/global_step"] for r in rows] == [0, 2]
    for name in RUN_LEVEL:
        assert [r[name] for r in rows] == [m.values[name] for m in expected], name
    assert expected[0].values["fpaudit/fp16/underflow"] > 0  # the tiny loss loses values


def test_huggingface_report_to_mlflow_and_wandb_gets_fpaudits_metrics(
    tmp_path: Path, offline: Path
) -> None:
    from tests.integrations.test_integrations import _gpt2, _train

    pytest.importorskip("transformers")
    _train(tmp_path, _gpt2(), report_to=["mlflow", "wandb"], max_steps=4, every=2)
    import wandb

    wandb.finish()
    report = Report.read(tmp_path / "report")
    expected = step_metrics(report, "fp16", top=0)
    assert [m.step for m in expected] == [0, 2]
    # the HF Trainer's own numbering: fpaudit's step k at global step k + 1 (its loss too)
    logged = mlflow_series(f"file:{offline}", "fpaudit")
    for name in RUN_LEVEL:
        assert logged[name] == [(m.step + 1, m.values[name]) for m in expected], name
    rows = [r for r in wandb_history(tmp_path / "wandb") if "train/fpaudit/fp16/underflow" in r]
    assert [r["train/global_step"] for r in rows] == [1, 3]
    for name in RUN_LEVEL:
        assert [r[f"train/{name}"] for r in rows] == [m.values[name] for m in expected], name
