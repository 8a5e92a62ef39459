"""Framework integrations: the Lightning and Hugging Face callbacks, and the HF sample models.

Each test skips, saying what to install, when its framework is missing.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fpaudit.errors import ModelFileError, UsageError
from fpaudit.report.records import KIND_BACKWARD, KIND_GRAD, LOSS_MODULE
from fpaudit.report.store import Report

from ..conftest import SAMPLES


def _lightning() -> Any:
    return pytest.importorskip("lightning", reason="needs PyTorch Lightning: pip install lightning")


def _transformers() -> Any:
    pytest.importorskip("accelerate", reason="HF Trainer needs accelerate: pip install accelerate")
    return pytest.importorskip(
        "transformers", reason="needs Hugging Face transformers: pip install transformers"
    )


def _records(report: Report, kind: str) -> pd.DataFrame:
    return report.records[report.records["kind"] == kind]


def _grad_amax(report: Report, step: int, module: str, param: str) -> float:
    grads = _records(report, KIND_GRAD)
    row = grads[(grads["step"] == step) & (grads["module"] == module) & (grads["op"] == param)]
    assert len(row) == 1, row
    return float(row["amax"].iloc[0])


# -- Lightning ---------------------------------------------------------------
def _fit(tmp_path: Path, *, max_steps: int = 4, **options: Any) -> tuple[Any, Report, Any]:
    """Fit a tiny LightningModule under the callback; the module, the report, the callback."""
    L = _lightning()
    from fpaudit.integrations.lightning import FpauditCallback

    fail_at = options.pop("fail_at", None)
    compiled = options.pop("compiled", False)  # trainer.fit(torch.compile(module))
    trainer_options = {
        k: options.pop(k) for k in ("accumulate_grad_batches", "precision", "plugins")
        if k in options
    }  # fmt: skip

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
            self.losses: list[float] = []  # every micro-batch's loss, as training_step saw it
            self.grads: list[float] = []  # max |net.0.weight.grad| before each optimizer step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if fail_at is not None and batch_idx == fail_at:
                raise RuntimeError("boom")
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            if not compiled:  # Dynamo fails on Lightning's log (torch 2.13, Lightning 2.6)
                self.log("train_loss", loss)
            self.losses.append(float(loss.detach()))
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # after unscale_
            self.grads.append(float(self.net[0].weight.grad.abs().max()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    callback = FpauditCallback(out=tmp_path / "report", **options)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **trainer_options,
    )
    module = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers and logging
        trainer.fit(torch.compile(module) if compiled else module, loader)
    return module, Report.read(tmp_path / "report"), callback


def _grad_counts(report: Report) -> dict[tuple[str, str], list[int]]:
    """Per (module, parameter): the gradient's calls, elements, zeros, infs and NaNs."""
    columns = ["calls", "elements", "zeros", "infs", "nans"]
    grads = _records(report, KIND_GRAD).groupby(["module", "op"])[columns].sum()
    return {key: [int(v) for v in row] for key, row in zip(grads.index, grads.values, strict=True)}


def _stored(report: Report) -> pd.DataFrame:
    """The values a compiled backward stored (fpaudit's backend handed them out)."""
    from fpaudit.capture.compiled import COMPILED_NODE

    return report.records[report.records["node"] == COMPILED_NODE]


def _reset_dynamo() -> None:
    torch._dynamo.reset()


def _check_names(report: Report, model: nn.Module) -> None:
    names = {name for name, _ in model.named_modules()}
    assert set(report.records["module"]) <= names | {LOSS_MODULE}
    assert {"net.0", "net.1", "net.2"} <= set(_records(report, KIND_BACKWARD)["module"])
    grads = _records(report, KIND_GRAD)
    assert set(zip(grads["module"], grads["op"], strict=True)) == {
        ("net.0", "weight"), ("net.0", "bias"), ("net.2", "weight"), ("net.2", "bias")
    }  # fmt: skip


def test_lightning_audits_the_first_steps(tmp_path: Path) -> None:
    module, report, callback = _fit(tmp_path, steps=2)
    assert callback.report_path == tmp_path / "report"
    assert list(report.steps["step"]) == [0, 1]
    assert report.meta["command"] == "lightning" and report.complete
    assert report.meta["steps_run"] == 4 and report.meta["steps_requested"] == 2
    assert report.meta["formats"] == ["fp16"] and report.meta["amp_dtype"] is None
    _check_names(report, module)
    assert list(report.steps["loss"]) == pytest.approx(module.losses[:2], rel=1e-6)
    assert list(report.steps["loss_scale"]) == [1.0, 1.0]
    assert report.steps["optimizer_step"].all() and not report.steps["skipped"].any()
    assert _grad_amax(report, 0, "net.0", "weight") == pytest.approx(module.grads[0], rel=1e-6)


def test_lightning_accumulation_is_one_step_per_optimizer_step(tmp_path: Path) -> None:
    module, report, _ = _fit(tmp_path, accumulate_grad_batches=2, steps=3, every=2)
    assert list(report.steps["step"]) == [0, 2]  # optimizer steps, not micro-batches
    assert report.meta["steps_run"] == 4 and report.meta["accumulate_grad_batches"] == 2
    _check_names(report, module)
    losses = module.losses  # 8 micro-batches; the step's loss is their mean
    expected = [(losses[0] + losses[1]) / 2, (losses[4] + losses[5]) / 2]
    assert list(report.steps["loss"]) == pytest.approx(expected, rel=1e-6)
    backward = _records(report, KIND_BACKWARD)
    assert (backward.loc[backward["module"] == "net.0", "calls"] == 2).all()  # both micro-batches
    # the gradients were recorded accumulated over both micro-batches
    assert _grad_amax(report, 0, "net.0", "weight") == pytest.approx(module.grads[0], rel=1e-6)


def test_lightning_bf16_mixed_records_bf16_backward_values(tmp_path: Path) -> None:
    module, report, _ = _fit(tmp_path, precision="bf16-mixed", steps=2)
    assert list(report.steps["step"]) == [0, 1]
    assert report.meta["amp_dtype"] == "bfloat16" and report.meta["formats"] == ["bf16"]
    assert report.meta["precision"] == "bf16-mixed"
    assert "bfloat16" in set(_records(report, KIND_BACKWARD)["dtype"])
    _check_names(report, module)
    assert np.isfinite(report.steps["loss"]).all()
    assert list(report.steps["loss"]) == pytest.approx(module.losses[:2], rel=1e-6)


def test_lightning_fp16_grad_scaler_gradients_are_recorded_before_unscale(tmp_path: Path) -> None:
    _lightning()
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # CPU fp16 AMP: torch >= 2.3
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    module, report, _ = _fit(tmp_path, plugins=[plugin], steps=2, formats=["fp16", "bf16"])
    assert list(report.steps["loss_scale"]) == [2.0**10, 2.0**10]
    assert set(_records(report, KIND_GRAD)["loss_scale"]) == {2.0**10}
    assert report.meta["amp_dtype"] == "float16" and report.meta["formats"] == ["fp16", "bf16"]
    # the report holds the scaled gradients: divided by the scale, what the optimizer saw
    recorded = _grad_amax(report, 0, "net.0", "weight") / 2.0**10
    assert recorded == pytest.approx(module.grads[0], rel=1e-6)
    assert list(report.steps["loss"]) == pytest.approx(module.losses[:2], rel=1e-6)  # unscaled


def test_lightning_exception_writes_an_incomplete_report(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, fail_at=3, steps=None)
    report = Report.read(tmp_path / "report")
    assert not report.complete and report.meta["stopped_by"] == "RuntimeError"
    assert list(report.steps["step"]) == [0, 1, 2]
    assert torch.autograd._engine_run_backward.__name__ == "_engine_run_backward"  # unhooked


def test_lightning_options_are_checked_before_training(tmp_path: Path) -> None:
    _lightning()
    from fpaudit.integrations.lightning import FpauditCallback

    with pytest.raises(UsageError, match="steps"):
        FpauditCallback(steps=0)
    with pytest.raises(UsageError, match="every"):
        FpauditCallback(every=0)
    with pytest.raises(UsageError, match="unknown format"):
        FpauditCallback(formats=["fp9"])
    (tmp_path / "report").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        _fit(tmp_path, force=False)
    with pytest.raises(UsageError, match="not an fpaudit report"):
        _fit(tmp_path, force=True)


# -- Hugging Face Trainer --------------------------------------------------------
def _gpt2() -> nn.Module:
    transformers = _transformers()
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
        bos_token_id=127, eos_token_id=127,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def _train(
    tmp_path: Path, model: nn.Module, *, scaler: Any = None, extra: Any = None, **options: Any
) -> Any:
    """Train ``model`` with the HF Trainer under the callback; the callback and the Trainer."""
    transformers = _transformers()
    from fpaudit.integrations.huggingface import FpauditTrainerCallback

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (32, 16), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args_options = {
        k: options.pop(k)
        for k in (
            "bf16",
            "fp16",
            "gradient_accumulation_steps",
            "max_grad_norm",
            "max_steps",
            "report_to",
            "torch_compile",
        )
        if k in options
    }
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=4,
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        **{"max_steps": 3, "report_to": [], **args_options},
    )
    callback = FpauditTrainerCallback(out=tmp_path / "report", **options)
    callbacks = [callback] + ([extra] if extra is not None else [])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    if scaler is not None:  # accelerate only builds a GradScaler for GPUs: give it a CPU one
        trainer.accelerator.scaler = scaler
        trainer.accelerator.native_amp = True
    try:
        trainer.train()
    finally:
        callback.finish()  # what the docstring asks for: a no-op after on_train_end
    return callback, trainer


def _probe(model: nn.Module, name: str) -> list[float]:
    """max |grad| of parameter ``name`` after each backward, before the Trainer touches it."""
    seen: list[float] = []
    param = dict(model.named_parameters())[name]
    param.register_post_accumulate_grad_hook(lambda p: seen.append(float(p.grad.abs().max())))
    return seen


def _logged_losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_huggingface_audits_every_step_with_the_models_names(tmp_path: Path) -> None:
    model = _gpt2()
    seen = _probe(model, "transformer.h.0.mlp.c_fc.weight")
    callback, trainer = _train(tmp_path, model, max_grad_norm=1e-3)  # clips every step
    report = Report.read(tmp_path / "report")
    assert callback.report_path == tmp_path / "report"
    assert list(report.steps["step"]) == [0, 1, 2]
    assert report.meta["command"] == "huggingface" and report.complete
    assert report.meta["steps_run"] == 3 and report.meta["precision"] == "fp32"
    names = {name for name, _ in model.named_modules()}
    modules = set(report.records["module"])
    assert modules <= names | {LOSS_MODULE}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= modules
    assert list(report.steps["loss"]) == pytest.approx(_logged_losses(trainer), rel=1e-5)
    assert list(report.steps["loss_scale"]) == [1.0, 1.0, 1.0]
    # recorded before clipping (max_grad_norm=1e-3 shrinks them by orders of magnitude)
    amax = [_grad_amax(report, s, "transformer.h.0.mlp.c_fc", "weight") for s in range(3)]
    assert amax == pytest.approx(seen, rel=1e-6)
    assert torch.autograd.backward.__module__ == "torch.autograd"  # every wrapper removed
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"


def test_huggingface_bf16_with_accumulation(tmp_path: Path) -> None:
    model = _gpt2()
    _, trainer = _train(
        tmp_path, model, bf16=True, gradient_accumulation_steps=2, max_steps=2, every=1
    )
    report = Report.read(tmp_path / "report")
    assert list(report.steps["step"]) == [0, 1]
    assert report.meta["amp_dtype"] == "bfloat16" and report.meta["precision"] == "bf16"
    assert report.meta["gradient_accumulation_steps"] == 2
    backward = _records(report, KIND_BACKWARD)
    assert (backward.loc[backward["module"] == "lm_head", "calls"] >= 2).all()
    assert list(report.steps["loss"]) == pytest.approx(_logged_losses(trainer), rel=1e-4)


def test_huggingface_fp16_grad_scaler_gradients_are_recorded_before_unscale(
    tmp_path: Path,
) -> None:
    model = _gpt2()
    seen = _probe(model, "transformer.h.1.mlp.c_proj.weight")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    _, trainer = _train(tmp_path, model, fp16=True, scaler=scaler, max_steps=2, steps=1)
    report = Report.read(tmp_path / "report")
    assert list(report.steps["step"]) == [0]
    assert list(report.steps["loss_scale"]) == [2.0**12]
    assert report.meta["amp_dtype"] == "float16"
    assert _grad_amax(report, 0, "transformer.h.1.mlp.c_proj", "weight") == pytest.approx(
        seen[0], rel=1e-6
    )
    assert seen[0] > 2.0**6  # still multiplied by the scale when recorded
    loss = report.steps["loss"].iloc[0]
    assert loss == pytest.approx(_logged_losses(trainer)[0], rel=1e-3) and math.isfinite(loss)
    assert "unscale_" not in vars(scaler)  # the wrapper is gone


def test_huggingface_exception_then_finish_writes_an_incomplete_report(tmp_path: Path) -> None:
    transformers = _transformers()

    class Boom(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:  # after the audit callback entered step 2
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _train(tmp_path, _gpt2(), extra=Boom())
    report = Report.read(tmp_path / "report")
    assert not report.complete and report.meta["stopped_by"] == "RuntimeError"
    assert list(report.steps["step"]) == [0, 1]  # the open step 2 is dropped
    assert torch.autograd.backward.__module__ == "torch.autograd"
    assert torch.autograd._engine_run_backward.__name__ == "_engine_run_backward"


# -- Hugging Face models as model files -----------------------------------------
@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ("hf_gpt2.py", {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"}),
        ("hf_bert.py", {"bert.encoder.layer.0.attention.self.query",
                        "bert.encoder.layer.1.output.dense", "cls.predictions.transform.dense"}),
    ],
)  # fmt: skip
def test_hf_samples_scan_with_the_models_own_names(sample: str, expected: set[str]) -> None:
    _transformers()
    from fpaudit.run.scan import ScanOptions, scan

    report = scan(SAMPLES / sample, ScanOptions(steps=2))
    assert len(report.steps) == 2 and report.steps["loss_finite"].all()
    assert expected <= set(_records(report, KIND_BACKWARD)["module"])
    # lm_head's weight is tied to transformer.wte's: its gradient is named by its first owner
    assert expected - {"lm_head"} <= set(_records(report, KIND_GRAD)["module"])


def test_hf_gpt2_sample_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _transformers()
    from fpaudit.cli.commands import run

    out = tmp_path / "report"
    assert run(["scan", str(SAMPLES / "hf_gpt2.py"), "--steps", "1", "--out", str(out)]) == 0
    assert Report.read(out).meta["steps"] == 1
    assert "Scanned 1 step(s)" in capsys.readouterr().out


def test_hf_samples_without_transformers_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fpaudit.run import modelfile

    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    for sample in ("hf_gpt2.py", "hf_bert.py"):
        with pytest.raises(ModelFileError, match="pip install transformers") as error:
            modelfile.load(SAMPLES / sample)
        assert "\n" not in str(error.value)


# -- compiled models under the callbacks --------------------------------------------
# Both callbacks train an MLP Linear(8, 32), GELU, Linear(32, 1) for 2 audited steps:
# per (module, parameter) one gradient call a step, of 32*8, 32, 32 and 1 elements, so
# [calls, elements, zeros, infs, NaNs] = [2, 2 * size, 0, 0, 0].
TWO_STEPS_OF_THE_MLP = {
    ("net.0", "weight"): [2, 2 * 32 * 8, 0, 0, 0], ("net.0", "bias"): [2, 2 * 32, 0, 0, 0],
    ("net.2", "weight"): [2, 2 * 32, 0, 0, 0], ("net.2", "bias"): [2, 2 * 1, 0, 0, 0],
}  # fmt: skip


def test_lightning_audits_a_compiled_module_as_its_eager_twin(tmp_path: Path) -> None:
    """trainer.fit(torch.compile(module)): the callback compiles Lightning's forward and
    training_step again through fpaudit's backend, so the compiled backward's stored
    buffers are counted under the model's own names. Per (module, parameter) the
    gradient's counts equal the eager twin's: 2 audited steps, 1 call each; elements
    2 * 32*8 = 512 (net.0.weight), 2 * 32 = 64 (net.0.bias), 2 * 32 = 64 (net.2.weight),
    2 * 1 = 2 (net.2.bias); no zero, inf or NaN."""
    _, eager, _ = _fit(tmp_path / "eager", steps=2)
    _reset_dynamo()
    try:
        module, report, callback = _fit(tmp_path / "compiled", steps=2, compiled=True)
    finally:
        _reset_dynamo()
    assert _grad_counts(eager) == TWO_STEPS_OF_THE_MLP
    assert _grad_counts(report) == _grad_counts(eager)
    assert list(report.steps["step"]) == [0, 1]
    eager_backward = set(_records(eager, KIND_BACKWARD)["module"]) - {LOSS_MODULE}
    assert eager_backward == {"net.0", "net.1", "net.2"}
    assert eager_backward <= set(_stored(report)["module"])  # the model's own names
    _check_names(report, module)
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 2
    assert info.not_covered == ()
    assert callback._in_place is None  # Lightning's compiled methods are back
    assert module._compiler_ctx is not None
    assert vars(module)["training_step"] is not None


class _Regressor(nn.Module):
    """A model the HF Trainer trains: batches of ``x`` and ``labels``, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


def _train_regressor(tmp_path: Path, **options: Any) -> tuple[nn.Module, Report]:
    transformers = _transformers()
    from fpaudit.integrations.huggingface import FpauditTrainerCallback

    torch.manual_seed(0)
    model = _Regressor()
    generator = torch.Generator().manual_seed(0)
    data = [
        {"x": torch.randn(8, generator=generator), "labels": torch.randn(1, generator=generator)}
        for _ in range(16)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, max_steps=2, **options,
    )  # fmt: skip
    callback = FpauditTrainerCallback(out=tmp_path / "report")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    try:
        trainer.train()
    finally:
        callback.finish()
    return model, Report.read(tmp_path / "report")


def test_huggingface_audits_torch_compile_as_its_eager_twin(tmp_path: Path) -> None:
    """torch_compile=True: the Trainer compiles the model inside train(), out of the
    callback's sight; the callback compiles the model's forward through fpaudit's
    backend, which the Trainer's wrapper then calls. Per (module, parameter) the
    gradient's counts equal the eager twin's: 2 steps, 1 call each; elements
    2 * 32*8 = 512, 2 * 32 = 64, 2 * 32 = 64, 2 * 1 = 2; no zero, inf or NaN."""
    _, eager = _train_regressor(tmp_path / "eager")
    _reset_dynamo()
    try:
        model, report = _train_regressor(tmp_path / "compiled", torch_compile=True)
    finally:
        _reset_dynamo()
    assert _grad_counts(eager) == TWO_STEPS_OF_THE_MLP
    assert _grad_counts(report) == _grad_counts(eager)
    eager_backward = set(_records(eager, KIND_BACKWARD)["module"]) - {LOSS_MODULE}
    assert eager_backward == {"", "net.0", "net.1", "net.2"}  # "": the model's loss
    assert eager_backward <= set(_stored(report)["module"])
    assert set(report.records["module"]) <= {n for n, _ in model.named_modules()} | {LOSS_MODULE}
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 2
    assert info.not_covered == ()
    assert "forward" not in vars(model)  # the model's own forward is back
