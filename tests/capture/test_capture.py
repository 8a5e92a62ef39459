"""Capture: every backward op attributed to its module, nothing left behind."""

from __future__ import annotations

import gc
import weakref

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

import fpaudit
from fpaudit.capture.oprules import creates_new_values
from fpaudit.report.records import KIND_BACKWARD, KIND_GRAD, LOSS_MODULE
from fpaudit.torch_internals import autograd_sequence_number, current_autograd_node

from ..models import zoo


@pytest.fixture(autouse=True, params=["backward only", "always on"])
def _mode_activation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every capture test runs twice: with the dispatch mode active only while the
    # engine runs (the default) and on for the whole context (the fallback).
    monkeypatch.setattr(fpaudit.Audit, "backward_only", request.param == "backward only")


def _audit(model: nn.Module, step_fn, steps: int = 1) -> pd.DataFrame:
    with fpaudit.audit(model) as audit:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss = step_fn()
            loss.backward()
            audit.step(loss=loss)
    return audit.report.records


def _modules(records: pd.DataFrame, kind: str = KIND_BACKWARD) -> set[str]:
    return set(records.loc[records["kind"] == kind, "module"])


def test_current_autograd_node_outside_and_inside_backward() -> None:
    assert current_autograd_node() is None
    seen: list[str] = []
    x = torch.randn(3, requires_grad=True)
    y = x.exp()

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            node = current_autograd_node()
            seen.append(node.name() if node is not None else "none")
            return grad

    Probe.apply(y).sum().backward()
    assert seen == ["ProbeBackward"]


def test_sequence_number_is_the_next_nodes() -> None:
    x = torch.randn(2, requires_grad=True)
    before = autograd_sequence_number()
    y = x * 2
    assert y.grad_fn is not None and y.grad_fn._sequence_nr() == before
    assert autograd_sequence_number() == before + 1


def test_mlp_ops_are_attributed_to_their_modules() -> None:
    model = zoo.MLP()
    x = torch.randn(5, 6)
    records = _audit(model, lambda: model(x).pow(2).mean())
    assert _modules(records) == {"fc1", "act", "fc2", LOSS_MODULE}
    fc1 = records[(records["module"] == "fc1") & (records["kind"] == KIND_BACKWARD)]
    # The input does not require grad, so fc1's backward computes only weight and bias grads.
    assert set(fc1["op"]) == {"aten.mm.default", "aten.sum.dim_IntList"}
    assert set(records.loc[records["module"] == "act", "op"]) == {"aten.tanh_backward.default"}
    grads = records[records["kind"] == KIND_GRAD]
    assert set(zip(grads["module"], grads["op"], strict=True)) == {
        ("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")
    }  # fmt: skip


def test_views_and_copies_are_not_recorded() -> None:
    model = zoo.MLP()
    records = _audit(model, lambda: model(torch.randn(4, 6)).sum())
    recorded = set(records["op"])
    for skipped in (
        "aten.t.default",
        "aten.view.default",
        "aten.expand.default",
        "aten.detach.default",
    ):
        assert skipped not in recorded


def test_creates_new_values() -> None:
    aten = torch.ops.aten
    x = torch.randn(3)
    assert not creates_new_values(aten.t.default, (x,), x.t())
    assert not creates_new_values(aten.clone.default, (x,), x.clone())
    assert not creates_new_values(aten.cat.default, ([x, x],), torch.cat([x, x]))
    assert creates_new_values(aten._to_copy.default, (x,), x.half())  # a cast rounds values
    assert creates_new_values(aten.mul.Tensor, (x, x), x * x)


def test_model_that_returns_its_own_loss() -> None:
    model = zoo.ReturnsLoss()
    x, labels = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    records = _audit(model, lambda: model(x, labels)["loss"])
    # Everything happens inside the model: the loss ops belong to the root module "",
    # the layers to their own names; backward module hooks would attribute nothing here.
    assert _modules(records) == {"", "body.fc1", "body.act", "body.fc2"}
    root_ops = set(records.loc[records["module"] == "", "op"])
    assert "aten.nll_loss_backward.default" in root_ops


def test_shared_module_and_tied_weights() -> None:
    model = zoo.SharedAndTied()
    ids = torch.randint(0, 10, (3, 5))
    records = _audit(model, lambda: model(ids).logsumexp(-1).mean())
    mix = records[(records["module"] == "mix") & (records["op"] == "aten.mm.default")]
    assert int(mix["calls"].sum()) >= 3  # used twice: weight grads twice, input grad once or more
    grads = records[records["kind"] == KIND_GRAD]
    # The tied weight is one parameter, under its first name.
    assert ("embed", "weight") in set(zip(grads["module"], grads["op"], strict=True))
    assert ("head", "weight") not in set(zip(grads["module"], grads["op"], strict=True))


def test_custom_autograd_function_is_attributed() -> None:
    model = zoo.CustomFunction()
    records = _audit(model, lambda: model(torch.randn(3, 4)).sum())
    square = records[records["module"] == "square"]
    assert set(square["node"]) == {"SquareBackward"}


def test_dict_outputs() -> None:
    model = zoo.DictOutput()
    records = _audit(model, lambda: sum(v.sum() for v in model(torch.randn(3, 4)).values()))
    assert {"a", "b"} <= _modules(records)


def test_checkpoint_recomputation_is_not_recorded_as_backward() -> None:
    model = zoo.Checkpointed()
    x = torch.randn(4, 6)
    records = _audit(model, lambda: model(x).sum())
    # The recomputed forward of inner (addmm, tanh) must not show up as backward values.
    assert "aten.addmm.default" not in set(records["op"])
    assert "aten.tanh.default" not in set(records["op"])
    assert {"inner.fc1", "inner.act", "inner.fc2", "out"} <= _modules(records)


def test_wrapper_modules_are_reported_under_the_models_own_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fpaudit.capture.clock import model_name

    assert model_name("_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.attn") == (
        "blocks.0.attn"
    )
    assert model_name("_fsdp_wrapped_module") == ""  # FSDP's root wraps the model
    assert model_name("net._fsdp_wrapped_modules") == "net._fsdp_wrapped_modules"  # a user's

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
    model = nn.Sequential(checkpoint_wrapper(inner), nn.Linear(8, 1))
    x = torch.randn(4, 6)
    with fpaudit.audit(model) as audit:
        model(x).sum().backward()
        audit.step()
    records = audit.report.records
    assert {"0.0", "0.1", "1"} <= _modules(records)  # "0" (a Sequential) runs no op itself
    assert audit.report.meta["modules"][1:] == ["", "0", "0.0", "0.1", "1"]  # once each
    assert not records["module"].str.contains("wrapped").any()
    assert "_checkpoint_wrapped_module" not in "".join(audit.report.meta["modules"])
    grads = records[records["kind"] == KIND_GRAD]
    assert set(zip(grads["module"], grads["op"], strict=True)) == {
        ("0.0", "weight"), ("0.0", "bias"), ("1", "weight"), ("1", "bias"),
    }  # fmt: skip
    # the recomputed forward (checkpointing) is still not recorded as backward
    assert "aten.addmm.default" not in set(records["op"])


def test_ddp_and_fabric_wrappers_are_named_as_the_model_names_itself() -> None:
    # DataParallel (DDP's naming: "module.") and Lightning Fabric's "_forward_module."
    # are wrappers; a model's own child called "module" is its own name
    from fpaudit.capture.clock import model_name, wrapped_paths

    assert model_name("_forward_module.decoder.0") == "decoder.0"
    assert model_name("module.fc") == "module.fc"  # a user's child named "module"
    assert model_name("module.fc", frozenset({"module"})) == "fc"

    class Own(nn.Module):  # a model whose own child is called "module"
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(4, 3)
            self.head = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.module(x)))

    x = torch.randn(5, 4)
    torch.manual_seed(0)
    bare = Own()
    torch.manual_seed(0)
    wrapped = nn.DataParallel(Own())  # on the CPU, it calls its module
    assert wrapped_paths(wrapped) == {"module"} and wrapped_paths(bare) == frozenset()
    reports = []
    for model in (bare, wrapped):
        with fpaudit.audit(model) as audit:
            model(x).sum().backward()
            audit.step()
        reports.append(audit.report)
    assert reports[0].meta["modules"] == reports[1].meta["modules"]
    assert reports[0].meta["modules"][1:] == ["", "module", "head"]
    columns = ["kind", "module", "node", "op", "elements", "zeros", "amax"]
    assert reports[0].records[columns].equals(reports[1].records[columns])


def test_frozen_layer_with_grad_requiring_successor() -> None:
    model = zoo.Frozen()
    records = _audit(model, lambda: model(torch.randn(2, 4)).sum())
    grads = records[records["kind"] == KIND_GRAD]
    assert set(grads["module"]) == {"trained"}


def test_values_computed_from_forward_values_do_not_scale_with_the_loss() -> None:
    model = zoo.WithRMSNorm()
    records = _audit(model, lambda: model(torch.randn(4, 8)).pow(2).mean())
    pow_node = records[(records["module"] == "norm") & (records["node"] == "PowBackward0")]
    by_op = dict(zip(pow_node["op"], pow_node["scales_with_loss"], strict=True))
    # pow's backward: x.pow(1) and * 2 read only the saved input; * grad scales.
    assert by_op == {
        "aten.pow.Tensor_Scalar": False,
        "aten.mul.Scalar": False,
        "aten.mul.Tensor": True,
    }
    assert records.loc[records["kind"] == KIND_GRAD, "scales_with_loss"].all()


def test_parameter_gradients_are_recorded_exactly() -> None:
    model = zoo.MLP()
    records = _audit(model, lambda: model(torch.randn(5, 6)).sum())
    fc2 = records[(records["kind"] == KIND_GRAD) & (records["module"] == "fc2")].set_index("op")
    assert fc2.loc["weight", "amax"] == float(model.fc2.weight.grad.abs().max())
    assert fc2.loc["weight", "elements"] == model.fc2.weight.numel()


def test_gradient_accumulation_in_one_step_accumulates_records() -> None:
    model = zoo.MLP()
    with fpaudit.audit(model) as audit:
        for _ in range(2):
            model(torch.randn(2, 6)).sum().backward()
        audit.step()
    records = audit.report.records
    fc2_mm = records[(records["module"] == "fc2") & (records["op"] == "aten.mm.default")]
    assert int(fc2_mm["calls"].sum()) == 4  # grad_input and grad_weight, twice
    assert audit.report.meta["steps"] == 1


def test_multi_output_ops_keep_their_output_index() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    records = _audit(model, lambda: model(torch.randn(3, 4)).pow(2).sum())
    norm = records[
        (records["module"] == "1") & (records["op"] == "aten.native_layer_norm_backward.default")
    ]
    assert set(norm["output"]) == {0, 1, 2}


def test_non_finite_loss_is_a_forward_problem() -> None:
    model = zoo.MLP()
    with fpaudit.audit(model) as audit:
        loss = model(torch.randn(2, 6)).sum() * float("nan")
        loss.backward()
        summary = audit.step(loss=loss)
    assert not summary.loss_finite
    report = audit.report
    assert report.records.empty  # never counted as backward overflow
    assert bool(report.steps.loc[0, "loss_finite"]) is False


def _hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_and_mode_are_removed_when_the_body_raises() -> None:
    model = zoo.MLP()
    before = _hook_counts(model)
    engine_entry = torch.autograd._engine_run_backward
    with pytest.raises(RuntimeError, match="boom"), fpaudit.audit(model):
        assert _hook_counts(model) > before
        if fpaudit.Audit.backward_only:
            assert torch.autograd._engine_run_backward is not engine_entry
            assert _get_current_dispatch_mode() is None  # forward runs without it
        else:
            assert _get_current_dispatch_mode() is not None
        model(torch.randn(2, 6)).sum().backward()
        raise RuntimeError("boom")
    assert _hook_counts(model) == before
    assert _get_current_dispatch_mode() is None
    assert torch.autograd._engine_run_backward is engine_entry
    assert model.fc1._forward_hooks_always_called == {}


def test_torch_autograd_grad_is_captured_too() -> None:
    model = zoo.MLP()
    with fpaudit.audit(model) as audit:
        loss = model(torch.randn(3, 6)).sum()
        torch.autograd.grad(loss, list(model.parameters()))
        audit.step()
    assert {"fc1", "act", "fc2"} <= set(audit.report.records["module"])


def test_hooks_removed_when_forward_raises_inside() -> None:
    model = zoo.MLP()
    with pytest.raises(RuntimeError), fpaudit.audit(model):
        model(torch.randn(2, 5))  # wrong width: fc1 raises in forward
    assert _hook_counts(model) == 0
    assert _get_current_dispatch_mode() is None


def test_no_tensor_is_retained() -> None:
    model = zoo.MLP()
    refs: list[weakref.ref[torch.Tensor]] = []
    with fpaudit.audit(model) as audit:
        x = torch.randn(64, 6)
        hidden = model.act(model.fc1(x))
        refs.append(weakref.ref(hidden))
        loss = model.fc2(hidden).sum()
        loss.backward()
        audit.step(loss=loss)
        del hidden, loss
        assert all(ref() is None for ref in refs)
    gc.collect()


def test_step_rejects_a_loss_with_many_elements() -> None:
    model = zoo.MLP()
    with fpaudit.audit(model) as audit, pytest.raises(ValueError, match="exactly one element"):
        audit.step(loss=torch.ones(3))


def test_audit_needs_a_module() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fpaudit.audit(lambda x: x)


def test_loss_outside_the_model_is_the_loss_pseudo_module() -> None:
    model = zoo.MLP()
    labels = torch.tensor([0, 2])
    records = _audit(model, lambda: F.cross_entropy(model(torch.randn(2, 6)), labels))
    loss_ops = set(records.loc[records["module"] == LOSS_MODULE, "op"])
    assert "aten.nll_loss_backward.default" in loss_ops


def test_selection_globs() -> None:
    selection = fpaudit.Selection(
        modules=("blocks.*",), exclude_modules=("*.ln*",), ops=("aten.mm.*",)
    )
    assert selection.accepts(KIND_BACKWARD, "blocks.0.attn", "aten.mm.default")
    assert not selection.accepts(KIND_BACKWARD, "blocks.0.ln1", "aten.mm.default")  # excluded
    assert not selection.accepts(KIND_BACKWARD, "head", "aten.mm.default")  # not included
    assert not selection.accepts(KIND_BACKWARD, "blocks.0.attn", "aten.sum.dim_IntList")
    assert selection.accepts(KIND_GRAD, "blocks.0.attn", "weight")  # op patterns skip grads
    assert fpaudit.Selection().accepts(KIND_BACKWARD, LOSS_MODULE, "anything")


def test_selection_limits_what_is_recorded() -> None:
    model = zoo.MLP()
    selection = fpaudit.Selection(exclude_modules=(LOSS_MODULE, "fc1"), ops=("aten.mm.*",))
    with fpaudit.audit(model, selection=selection) as audit:
        model(torch.randn(4, 6)).pow(2).sum().backward()
        audit.step()
    records = audit.report.records
    backward = records[records["kind"] == KIND_BACKWARD]
    assert set(backward["module"]) == {"fc2"} and set(backward["op"]) == {"aten.mm.default"}
    assert set(records.loc[records["kind"] == KIND_GRAD, "module"]) == {"fc2"}


def test_step_index_numbers_captured_steps() -> None:
    model = zoo.MLP()
    audit = fpaudit.audit(model)
    for index in (0, 4, 8):
        with audit:
            model(torch.randn(2, 6)).sum().backward()
            assert audit.step(index=index).step == index
    assert list(audit.report.steps["step"]) == [0, 4, 8]
    with pytest.raises(ValueError, match="does not follow"), audit:
        audit.step(index=8)


class _AtenBackward(torch.autograd.Function):
    """A backward that calls aten itself: Python numbers where the schema says Tensor,
    ops with one, two and three tensor arguments, and a list of tensors."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * 1.5

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        aten = torch.ops.aten
        doubled = aten.mul.Tensor(x, 2.0)  # from the saved input and a number: fixed
        shifted = aten.add.Tensor(doubled, 3)
        chosen = aten.where.self(aten.gt.Scalar(x, 0), shifted, doubled)  # three, all fixed
        stacked = aten.stack.default([chosen, aten.exp.default(chosen)])  # a list, all fixed
        mixed = aten.addcmul.default(chosen, stacked[1], doubled)  # three, all fixed
        return aten.mul.Tensor(aten.mul.Tensor(grad, mixed), 0.5)  # the gradient: scaled


class _AtenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AtenBackward.apply(self.fc(x))


def test_scales_with_loss_is_what_scaling_the_loss_does_with_numbers_at_tensor_places() -> None:
    # The oracle: run the same step with the loss times 2**10. A record that scales with
    # the loss has its amax times 2**10 exactly (powers of two, far from the edges); one
    # that does not has it unchanged. The schema's tensor places hold numbers here.
    torch.manual_seed(0)
    model, batch = _AtenModel(), torch.randn(3, 4)
    by_scale = {}
    for scale in (1.0, 2.0**10):
        records = _audit(model, lambda scale=scale: model(batch).pow(2).sum() * scale)
        ours = records[records["node"] == "_AtenBackwardBackward"]
        by_scale[scale] = {
            (op, out, flag): amax
            for op, out, flag, amax in zip(ours["op"], ours["output"], ours["scales_with_loss"],
                                           ours["amax"], strict=True)
        }  # fmt: skip
    # the same records (op, output, whether it scales) in both runs
    assert by_scale[1.0].keys() == by_scale[2.0**10].keys()
    for key, amax in by_scale[1.0].items():
        assert by_scale[2.0**10][key] == (amax * 2.0**10 if key[2] else amax), key
    flags = {(op, flag) for op, _, flag in by_scale[1.0]}
    # (stack only moves values: not recorded, but what addcmul reads is fixed through it)
    assert {("aten.mul.Tensor", False), ("aten.add.Tensor", False), ("aten.where.self", False),
            ("aten.addcmul.default", False), ("aten.mul.Tensor", True)} <= flags  # fmt: skip
