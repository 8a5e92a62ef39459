"""The compiled zoo: every model torch.compile trains is audited compiled, under the
model's own names.

Oracles that share no fpaudit code: the compiled net's own ``.grad`` (each parameter
gradient's elements and zeros, counted from the tensor), and the eager twin (the same
class and seed, no compile) for which modules have backward values. Each net compiles
once (a module-scoped cache); the nets are tiny.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fpaudit
from fpaudit import _threads
from fpaudit import torch_internals_compile as compile_internals
from fpaudit.capture import compiled
from fpaudit.report.records import KIND_BACKWARD, KIND_GRAD, LOSS_MODULE
from fpaudit.report.store import Report
from fpaudit.rules import gating
from tests.conftest import MODELS, ROOT
from tests.models.compiled_zoo import ZOO, Mixture, sequences, tokens

LSTM_LINE = (
    "Dynamo ran part of the model eagerly (a graph break, or a module it does not trace, "
    "as nn.LSTM): those backward ops are recorded under (root), not their own submodules"
)


def _step(model: nn.Module, batch: torch.Tensor) -> Report:
    with fpaudit.audit(model) as audit:
        model(batch).float().square().mean().backward()
        audit.step()
    return audit.report


@functools.cache
def audited(name: str) -> tuple[Report, Report, nn.Module]:
    """(eager twin's report, compiled report, the compiled run's eager net) for one step."""
    net_class, batch = ZOO[name]
    torch.manual_seed(0)
    eager = _step(net_class(), batch())
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = net_class()
    try:
        report = _step(compiled.compile(net), batch())
    finally:
        torch._dynamo.reset()
    return eager, report, net


def _backward_modules(report: Report, node: str | None = None) -> set[str]:
    records = report.records
    rows = records[records["kind"] == KIND_BACKWARD]
    if node is not None:
        rows = rows[rows["node"] == node]
    return set(rows["module"]) - {LOSS_MODULE}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_each_parameter_gradient_is_counted_as_the_compiled_nets_own_grad(name: str) -> None:
    _, report, net = audited(name)
    records = report.records
    grads = records[records["kind"] == KIND_GRAD].groupby(["module", "op"])[["elements", "zeros"]]
    counted = {key: (int(e), int(z)) for key, (e, z) in grads.sum().iterrows()}
    own = {}
    for qualified, parameter in net.named_parameters():
        module, _, leaf = qualified.rpartition(".")
        assert parameter.grad is not None, qualified
        own[(module, leaf)] = (parameter.grad.numel(), int((parameter.grad == 0).sum()))
    assert counted == own


def _plain_step(name: str) -> nn.Module:
    """The net after one step of plain ``torch.compile``, as :func:`audited` runs it."""
    net_class, batch = ZOO[name]
    torch.manual_seed(0)
    net = net_class()
    torch._dynamo.reset()
    try:
        torch.compile(net)(batch()).float().square().mean().backward()
    finally:
        torch._dynamo.reset()
    return net


@pytest.mark.parametrize("name", sorted(ZOO))
def test_each_gradient_equals_plain_torch_compiles_bit_for_bit(name: str) -> None:
    """Audited under fpaudit.compile, the net computes what plain torch.compile computes:
    every parameter gradient bit for bit (the audit observes the buffers the compiled
    backward stores; it changes none of Inductor's fusions or reductions)."""
    _, _, audited_net = audited(name)
    plain = dict(_plain_step(name).named_parameters())
    for qualified, parameter in audited_net.named_parameters():
        theirs = plain[qualified].grad
        assert parameter.grad is not None and theirs is not None, qualified
        assert torch.equal(parameter.grad, theirs), qualified


def _train(compiler: Any, audited_steps: frozenset[int], steps: int = 3) -> list[dict[str, Any]]:
    """Each step's gradients of the encoder layer under ``compiler`` (SGD between steps),
    the steps in ``audited_steps`` under an open audit."""
    net_class = ZOO["encoder_layer"][0]
    torch.manual_seed(0)
    net = net_class()
    torch._dynamo.reset()
    model = compiler(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    grads = []
    try:
        for step in range(steps):
            optimizer.zero_grad()
            x = sequences(step)
            if step in audited_steps:
                with fpaudit.audit(model) as audit:
                    model(x).square().mean().backward()
                    audit.step()
                assert audit.report.info.compiled is not None
                assert audit.report.info.compiled.observed_backward_runs == 1
            else:
                model(x).square().mean().backward()
            grads.append(
                {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            )
            optimizer.step()
    finally:
        torch._dynamo.reset()
    return grads


def test_the_encoder_layer_trains_as_plain_torch_compile_with_the_audit_open_or_closed() -> None:
    """Issue 51: a pre-norm TransformerEncoderLayer's in_proj_bias gradient was one ulp
    off plain torch.compile under fpaudit.compile, audit open or closed. Three SGD steps:
    closed, open, closed; every gradient of every step bit for bit."""
    plain = _train(torch.compile, frozenset())
    observed = _train(compiled.compile, frozenset({1}))
    for step, (theirs, mine) in enumerate(zip(plain, observed, strict=True)):
        assert theirs.keys() == mine.keys()
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), (step, name)


def test_the_resnet_shaped_nets_gradients_are_counted_by_hand() -> None:
    # conv1 8*3*7*7 = 1176, bn1 8 + 8, layer1.conv1 and conv2 8*8*3*3 = 576 each,
    # layer1.bn1 and bn2 8 + 8 each, fc 10*8 + 10 = 90: 1176 + 16 + 1152 + 32 + 90 = 2466
    _, report, _ = audited("resnet_shaped")
    records = report.records
    assert int(records[records["kind"] == KIND_GRAD]["elements"].sum()) == 2466


@pytest.mark.parametrize("name", sorted(set(ZOO) - {"lstm_tagger"}))
def test_every_module_with_eager_backward_values_is_stored_or_fused_away(name: str) -> None:
    eager, report, _ = audited(name)
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 1
    assert info.not_covered == ()
    stored = _backward_modules(report, compiled.COMPILED_NODE)
    assert stored, "no stored value observed"
    assert _backward_modules(eager) <= stored | set(info.fused_away)
    assert stored <= set(report.info.modules) | {""}  # the model's own names


def test_maxpool_and_the_index_ops_backward_values_are_stored_under_their_modules() -> None:
    """The ops whose backward once crashed the compiled audit (a scatter into zeros,
    which Inductor lays out as a buffer with no layout of its own)."""
    stored = _backward_modules(audited("pools")[1], compiled.COMPILED_NODE)
    assert {"conv", "maxpool", "adaptive_max", "fc"} <= stored
    stored = _backward_modules(audited("sparse")[1], compiled.COMPILED_NODE)
    assert {"embedding", "bag", "gather", "scatter_add", "sort", "topk", "cumsum"} <= stored


def test_a_wrapped_forward_keeps_every_modules_name() -> None:
    # Dynamo names the module L['args'][0]: before, every value landed under the root
    eager, report, _ = audited("wrapped_forward")
    assert _backward_modules(report, compiled.COMPILED_NODE) == _backward_modules(eager)
    assert _backward_modules(eager) == {"fc1", "act", "fc2", "fc3"}


def test_the_models_own_ops_belong_to_the_model_not_to_the_next_module() -> None:
    """OwnOps' mean over tokens and its product with a row sum are the model's own ops
    (eager: module ""). Compiled, their backward (the mean's division, the products) is
    fused into kernels: the fused-away ops are the model's, not ``head``'s or ``fc``'s."""
    eager, report, _ = audited("own_ops")
    assert "" in _backward_modules(eager)
    info = report.info.compiled
    assert info is not None
    assert {"aten.div.Scalar", "aten.mul.Tensor"} <= set(info.fused_away[""])
    for module in ("head", "fc"):
        assert "aten.div.Scalar" not in info.fused_away.get(module, ())


def test_an_lstm_dynamo_leaves_to_eager_is_captured_and_said() -> None:
    """Dynamo does not trace nn.LSTM: the LSTM runs eagerly inside the compiled tagger
    (torch 2.13 runs the whole forward eagerly; 2.15 compiles the rest). Its backward is
    captured by the dispatch mode under the model (no hook runs inside a compiled
    module), the report says so, and the gate judges what was captured."""
    eager, report, _ = audited("lstm_tagger")
    info = report.info.compiled
    assert info is not None and LSTM_LINE in info.not_covered
    records, eager_records = report.records, eager.records
    backward = records[records["kind"] == KIND_BACKWARD]
    ran_eagerly = backward[
        (backward["node"] != compiled.COMPILED_NODE) & (backward["module"] != LOSS_MODULE)
    ]
    assert set(ran_eagerly["module"]) == {""}
    eager_backward = eager_records[eager_records["kind"] == KIND_BACKWARD]
    assert _backward_modules(eager) == {"", "embedding", "norm", "lstm", "head"}  # "": tanh
    assert "lstm" not in _backward_modules(report)
    stored_or_fused = _backward_modules(report, compiled.COMPILED_NODE) | set(info.fused_away)
    for module in _backward_modules(eager) - stored_or_fused:
        # left to eager (the LSTM on every release): its backward nodes, under the model
        nodes = set(eager_backward[eager_backward["module"] == module]["node"])
        assert nodes and nodes <= set(ran_eagerly["node"]), module
    failures = gating.gate(report, "fp16", 1.0).failures
    assert not [f for f in failures if gating.NOTHING_MEASURED in f.kinds]


# -- module paths from every frame shape Dynamo writes ----------------------------------
@pytest.mark.parametrize(
    ("dynamo", "named"),
    [
        ("L['self'].blocks.0.fc1", "blocks.0.fc1"),
        ("L['self']._modules['blocks']._modules['0'].fc1", "blocks.0.fc1"),
        ("L['args'][0].model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
        ("L['kwargs']['model'].encoder.layer[3]", "encoder.layer.3"),
        ("G['net'].head", "head"),
        ("L['self']", ""),
        ("L['args'][0]", ""),
    ],
)
def test_module_paths_from_any_frame_shape(dynamo: str, named: str) -> None:
    assert compiled.module_path(dynamo) == named


def test_a_compiled_frame_is_named_by_the_parameters_of_its_own_module() -> None:
    # where Dynamo reads each input of an Expert.forward frame: its own module's
    # parameters say, at each run, which expert runs it; a global's or an input do not
    sources = [
        "L['x']",
        "L['self']._modules['up']._parameters['weight']",
        "L['self']._parameters['scale']",
        "G['net']._modules['fc']._parameters['weight']",
        None,
    ]
    assert compiled.frame_parameters(sources) == (
        compiled.FrameParameter(position=1, module="up", name="weight"),
        compiled.FrameParameter(position=2, module="", name="scale"),
    )


# -- what cannot be observed is skipped and said, never a crash --------------------------
def test_a_backward_graph_that_cannot_be_compiled_observed_runs_as_inductor_compiles_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no such buffer kind\nsecond line")

    monkeypatch.setattr(compile_internals, "inductor_backward", refuse)
    net_class, batch = ZOO["pools"]
    torch.manual_seed(0)
    plain_net = net_class()
    torch._dynamo.reset()
    torch.compile(plain_net)(batch()).square().mean().backward()
    torch.manual_seed(0)
    net = net_class()
    torch._dynamo.reset()
    try:
        report = _step(compiled.compile(net), batch())
    finally:
        torch._dynamo.reset()
        compiled._not_covered.clear()  # (compile-time lines outlive the audit)
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 0
    assert info.not_covered == (
        "a compiled backward graph's stored values could not be observed "
        "(RuntimeError: no such buffer kind): it runs as Inductor compiles it, unobserved",
    )
    for mine, theirs in zip(net.parameters(), plain_net.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad, theirs.grad)
    failures = gating.gate(report, "fp16", 1.0).failures
    assert [f for f in failures if gating.NOTHING_MEASURED in f.kinds]


def test_a_buffer_that_cannot_be_read_is_named_and_the_others_observed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # an empty Inductor cache: the graph is compiled here, its buffers read here (one
    # cached with its plan by an earlier test would be loaded, its buffers not read)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    read = compile_internals._read_buffer

    def unreadable_extern(name: str, buffer: Any) -> Any:
        if type(buffer).__name__ == "ExternKernelOut":
            raise NotImplementedError("a new layout")
        return read(name, buffer)

    monkeypatch.setattr(compile_internals, "_read_buffer", unreadable_extern)
    torch._dynamo.reset()
    try:
        report = _step(compiled.compile(ZOO["regularised"][0]()), ZOO["regularised"][1]())
    finally:
        torch._dynamo.reset()
        lines = list(compiled._not_covered)
        compiled._not_covered.clear()
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 1
    assert lines and all(
        "could not be read (ExternKernelOut: NotImplementedError" in x for x in lines
    )
    assert list(info.not_covered) == lines
    # the matmuls (extern kernels) are not observed; the activations' stored values are
    assert {"leaky", "relu"} <= _backward_modules(report, compiled.COMPILED_NODE)


# -- a model file: a compiled ResNet-shaped net, scanned in a real process ---------------
def test_scan_audits_a_compiled_resnet_and_blames_no_thread_on_the_model(tmp_path: Path) -> None:
    """`fpaudit scan` of a model file returning torch.compile(net): exit 0, the gradient
    counts of 2 steps (2 * 2466, counted above), MaxPool's backward stored, and no note
    about threads: Inductor's compile workers are torch's."""
    out = tmp_path / "report"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fpaudit",
            "scan",
            str(MODELS / "compiled_zoo.py"),
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "thread" not in done.stderr, done.stderr
    report = Report.read(out)
    records = report.records
    assert int(records[records["kind"] == KIND_GRAD]["elements"].sum()) == 2 * 2466
    assert "maxpool" in _backward_modules(report, compiled.COMPILED_NODE)


def test_threads_torch_starts_are_not_the_models() -> None:
    stop = threading.Event()
    namespace: dict[str, Any] = {"__name__": "torch._inductor.fake_pool", "stop": stop}
    with _threads.watching():
        mine = threading.Thread(target=stop.wait, name="prefetcher")
        mine.start()
        exec("import threading\nt = threading.Thread(target=stop.wait)\nt.start()", namespace)
        left = _threads.left_by_model()
    stop.set()
    mine.join()
    namespace["t"].join()
    assert threading.Thread.start is _threads._original_start
    assert mine in left and namespace["t"] not in left


# -- a Hugging Face Llama, compiled --------------------------------------------------------
def test_a_compiled_hf_llama_names_its_modules_as_the_eager_one() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def step(model: nn.Module) -> Report:
        with fpaudit.audit(model) as audit:
            model(input_ids=ids, labels=ids).loss.backward()
            audit.step()
        return audit.report

    torch.manual_seed(0)
    eager = step(transformers.LlamaForCausalLM(config))
    torch.manual_seed(0)
    torch._dynamo.reset()
    try:
        report = step(compiled.compile(transformers.LlamaForCausalLM(config)))
    finally:
        torch._dynamo.reset()
    info = report.info.compiled
    assert info is not None and info.not_covered == ()
    stored = _backward_modules(report, compiled.COMPILED_NODE)
    assert "model.layers.0.self_attn.q_proj" in stored and "model.embed_tokens" in stored
    assert _backward_modules(eager) <= stored | set(info.fused_away)


# -- a graph break that compiles each expert of a mixture as a frame of its own ----------
def _elements(report: Report, node: str | None = None) -> dict[str, int]:
    """Backward values per module (the loss's left out), of one node's records or all."""
    records = report.records
    rows = records[(records["kind"] == KIND_BACKWARD) & (records["module"] != LOSS_MODULE)]
    if node is not None:
        rows = rows[rows["node"] == node]
    return {str(m): int(n) for m, n in rows.groupby("module")["elements"].sum().items()}


def test_a_mixture_files_each_compiled_experts_values_under_that_expert() -> None:
    """Issue 50: the mixture's routing breaks Dynamo's graph, so each Expert.forward is a
    compiled frame of its own, and experts 2 and 3 run the graph compiled for expert 1.
    Every value those frames store is the expert's that ran it, as in the eager twin;
    none is the model's (``(root)``). (Not in ZOO: a net run before the decoder's plain
    compile there moves its ConvTranspose weight gradient by an ulp, audit or not.)"""
    torch.manual_seed(0)
    eager = _step(Mixture(), tokens())
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Mixture()
    plain = copy.deepcopy(net)
    try:
        report = _step(compiled.compile(net), tokens())
        torch._dynamo.reset()
        torch.compile(plain)(tokens()).square().mean().backward()
    finally:
        torch._dynamo.reset()
    # the audit changes nothing the compiled experts compute
    plain_parameters = dict(plain.named_parameters())
    for qualified, parameter in net.named_parameters():
        theirs_grad = plain_parameters[qualified].grad
        assert parameter.grad is not None and theirs_grad is not None, qualified
        assert torch.equal(parameter.grad, theirs_grad), qualified
    eager_counts, stored = _elements(eager), _elements(report, compiled.COMPILED_NODE)
    experts = {f"experts.{e}{part}" for e in range(4) for part in ("", ".up", ".down")}
    assert {m for m in eager_counts if m.startswith("experts")} == experts
    # 4, 2, 7 and 3 tokens: GELU's backward in expert e holds tokens * 16 values, 64, 32,
    # 112 and 48, all different, so an expert's values filed under another show.
    gelu = {m: n for m, n in eager_counts.items() if m.count(".") == 1}
    assert sorted(gelu.values()) == [32, 48, 64, 112]
    # Compiled, each expert stores what its eager twin computes op by op: the mm and the
    # bias sum of up and down, GELU's backward as one fused product (eager's
    # gelu_backward): per module, as many values as eager, under the same name.
    assert stored == {m: eager_counts[m] for m in experts}
    records = report.records
    mine = records[records["node"] == compiled.COMPILED_NODE]
    theirs = eager.records[eager.records["module"].isin(experts)]
    for op in ("aten.mm.default", "aten.sum.dim_IntList"):
        count = {
            str(m): int(n)
            for m, n in mine[mine["op"] == op].groupby("module")["elements"].sum().items()
        }
        assert count == {
            str(m): int(n)
            for m, n in theirs[theirs["op"] == op].groupby("module")["elements"].sum().items()
        }, op
    # The model's forward runs eagerly inside the compiled model, where no hook runs: its
    # own ops and the router's and out's are the model's (the line below says so).
    assert _elements(report)[""] == eager_counts[""] + eager_counts["router"] + eager_counts["out"]
    info = report.info.compiled
    assert info is not None and info.observed_backward_runs == 4
    assert LSTM_LINE in info.not_covered
    assert set(info.fused_away) <= experts
