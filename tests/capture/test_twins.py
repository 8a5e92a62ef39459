"""Twins: a model with activation checkpointing or backward hooks against the same model
without them. Recomputation is forward work and hooks are not the model's gradient, so
per module, every backward histogram must equal the plain twin's exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import fpaudit
from fpaudit.report.store import Report
from fpaudit.rules.recommendation import recommend
from tests.reports import bins_per_module

Mode = str  # what is checkpointed: "module", "method" or "function"; "plain": nothing


def residual_fn(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Ops outside every submodule: only a checkpointed method/function has them."""
    return torch.tanh(x * scale) + x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc2(F.gelu(self.fc1(x)))
        return residual_fn(hidden, self.scale) * 1e-3


class Net(nn.Module):
    def __init__(self, how: Mode, reentrant: bool, checkpointed: bool = True) -> None:
        super().__init__()
        self.how, self.reentrant, self.checkpointed = how, reentrant, checkpointed
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = self._run(block, h)
        return self.out(h)

    def _run(self, block: Block, h: torch.Tensor) -> torch.Tensor:
        def run(target: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
            if not self.checkpointed:  # the twin: the same calls, no checkpoint
                return target(t)
            return checkpoint(target, t, use_reentrant=self.reentrant)

        if self.how == "plain":
            return block(h)
        if self.how == "module":
            return run(block, h)
        if self.how == "method":
            return run(block.body, h)  # not __call__: `block`'s hooks never fire
        return block.fc2(run(lambda t: F.gelu(block.fc1(t)) * 2.0, h))  # a plain function


def audited(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> Report:
    with fpaudit.audit(model) as audit:
        loss = loss_fn(model)
        loss.backward()
        audit.step(loss)
    return audit.report


def net_loss(x: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    return lambda model: model(x).square().mean()


def make_net(how: Mode, reentrant: bool, checkpointed: bool = True) -> Net:
    torch.manual_seed(3)
    return Net(how, reentrant, checkpointed)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("how", ["module", "method", "function"])
def test_checkpointing_counts_equal_the_plain_twins(how: Mode, reentrant: bool) -> None:
    x = torch.randn(64, 8)
    plain = bins_per_module(audited(make_net(how, reentrant, checkpointed=False), net_loss(x)))
    checkpointed = bins_per_module(audited(make_net(how, reentrant), net_loss(x)))
    assert set(checkpointed) == set(plain)
    for module, counts in plain.items():
        assert checkpointed[module] == counts, f"{how} checkpointing changed {module!r}"
    # a method's or function's own ops (tanh, the residual add) belong to the caller
    assert plain["" if how != "module" else "blocks.0"][0] > 0


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=127, eos_token_id=127,
    )  # fmt: skip
    torch.manual_seed(4)
    lm = transformers.GPT2LMHeadModel(config)
    lm.loss_type = "ForCausalLM"
    return lm.train()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_hugging_face_gradient_checkpointing_counts_equal_the_plain_twin(reentrant: bool) -> None:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(model: nn.Module) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    plain = bins_per_module(audited(_gpt2(), loss))
    twin = _gpt2()
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert twin.is_gradient_checkpointing
    checkpointed = bins_per_module(audited(twin, loss))
    assert set(checkpointed) == set(plain)
    for module, counts in plain.items():
        assert checkpointed[module] == counts, f"checkpointing changed {module!r}"


def _optimizer_in_backward(model: nn.Module) -> list[Any]:
    """PyTorch's documented pattern: one Adam per parameter, stepped as its gradient lands."""
    optimizers = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}

    def step(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    return [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]


def test_optimizer_in_backward_is_not_recorded_as_backward_values() -> None:
    x = torch.randn(64, 8)
    plain_report = audited(make_net("plain", False), net_loss(x))
    model = make_net("plain", False)
    _optimizer_in_backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    hooked_report = audited(model, net_loss(x))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert bins_per_module(hooked_report) == bins_per_module(plain_report)
    plain, hooked = recommend(plain_report, "fp16"), recommend(hooked_report, "fp16")
    assert (hooked.log2_scale, hooked.amax, hooked.limiting_op, hooked.limiting_module) == (
        plain.log2_scale, plain.amax, plain.limiting_op, plain.limiting_module,
    )  # fmt: skip


def test_a_state_updating_post_accumulate_hook_is_not_recorded() -> None:
    """An exponential moving average of each gradient, kept by a hook."""
    x = torch.randn(64, 8)
    plain_report = audited(make_net("plain", False), net_loss(x))
    model = make_net("plain", False)
    averages = {p: torch.zeros_like(p) for p in model.parameters()}

    def track(param: torch.Tensor) -> None:
        with torch.no_grad():
            averages[param].mul_(0.9).add_(param.grad.square(), alpha=0.1)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(track)
    hooked_report = audited(model, net_loss(x))
    assert all(a.abs().sum() > 0 for a in averages.values())
    assert bins_per_module(hooked_report) == bins_per_module(plain_report)


def test_gradient_accumulation_is_still_recorded() -> None:
    """The AccumulateGrad node's own work, adding a second backward into ``.grad``, stays."""
    x = torch.randn(64, 8)
    model = make_net("plain", False)
    with fpaudit.audit(model) as audit:
        net_loss(x)(model).backward()
        net_loss(x)(model).backward()
        audit.step()
    records = audit.report.records
    accumulated = records[records["node"] == "torch::autograd::AccumulateGrad"]
    assert set(accumulated["op"]) == {"aten.add_.Tensor"}
    # one add_ per parameter: 2 (inp) + 2 blocks * 5 + 2 (out) = 14 tensors
    assert int(accumulated["calls"].sum()) == 14


def test_torch_compile_aot_eager_is_captured_and_attributed_like_eager() -> None:
    """aot_eager runs the compiled backward graph op by op through aten, so the dispatch
    mode sees every op and module hooks (a graph break each) still stamp the clock."""
    x = torch.randn(64, 8)

    def make() -> nn.Module:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    eager = bins_per_module(audited(make(), net_loss(x)))
    model = make()
    compiled = torch.compile(model, backend="aot_eager")
    with fpaudit.audit(model) as audit:
        loss = compiled(x).square().mean()
        loss.backward()
        audit.step(loss)
    records = audit.report.records
    assert "CompiledFunctionBackward" in set(records["node"])  # it really was compiled
    assert bins_per_module(audit.report) == eager


def test_a_hook_that_changes_the_gradient_in_place_is_recorded() -> None:
    """Dividing ``.grad`` in place (FSDP's pre-division before its reduce-scatter, a
    hand-written all-reduce average) makes gradient values: they are recorded."""
    x = torch.randn(64, 8)
    model = make_net("plain", False)

    def divide_by_4(param: torch.Tensor) -> None:
        assert param.grad is not None
        param.grad.div_(4)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(divide_by_4)
    records = audited(model, net_loss(x)).records
    divided = records[records["op"] == "aten.div_.Tensor"]
    assert set(divided["node"]) == {"torch::autograd::AccumulateGrad"}
    # every parameter's gradient: 14 tensors, 8*16+16 + 2*(16*32+32+32*16+16+16) + 16*4+4
    assert int(divided["calls"].sum()) == 14
    assert (
        int(divided["elements"].sum())
        == 8 * 16 + 16 + 2 * (16 * 32 + 32 + 32 * 16 + 16 + 16) + 16 * 4 + 4
    )
