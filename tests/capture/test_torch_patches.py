"""Every function or method `fpaudit run` patches behaves as the original does.

For each patched callable (``torch_patches.targets()``), the same calls are made
positionally, by keyword and mixed, once on a fresh world without fpaudit and once
on an identical fresh world with the training monitor installed; the results and
the side effects (parameters, gradients, scaler and scheduler state) must be
bit-identical. The oracle is torch itself, unpatched.
"""

from __future__ import annotations

import inspect
import io
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from fpaudit.capture import torch_patches as patches
from fpaudit.run.training import RunOptions, TrainingMonitor

GradScaler = torch.amp.GradScaler


@dataclass
class World:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    scheduler: Any = None
    loss: torch.Tensor | None = None


def _world(scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> World:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    world = World(model, optimizer, scaler)
    if scheduler is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            world.scheduler = scheduler(optimizer)
    x = torch.randn(5, 3)
    world.loss = model(x).pow(2).mean()
    return world


def _with_grads(world: World, scaled: bool = True) -> World:
    assert world.loss is not None
    (world.scaler.scale(world.loss) if scaled else world.loss).backward()
    return world


def _state(world: World) -> bytes:
    """Everything a call may change, as bytes (tensors compared bit for bit)."""
    grads = [p.grad for p in world.model.parameters()]
    scaler = world.scaler.state_dict()
    scheduler = world.scheduler.state_dict() if world.scheduler is not None else None
    buffer = io.BytesIO()
    torch.save(
        {
            "params": [p.detach().clone() for p in world.model.parameters()],
            "grads": grads,
            "optimizer": world.optimizer.state_dict(),
            "scaler": scaler,
            "scale": world.scaler._scale,
            "scheduler": pickle.dumps(scheduler),
            "lr": [g["lr"] for g in world.optimizer.param_groups],
        },
        buffer,
    )
    return buffer.getvalue()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b) or (a.isnan() & b.isnan()).all())
        )
    return type(a) is type(b) and a == b


def _clip_norm(owner: Any) -> list[tuple[str, Callable[[World], Any]]]:
    f = lambda: owner.clip_grad_norm_  # noqa: E731 (read at call time: patched or not)
    return [
        ("positional", lambda w: f()(list(w.model.parameters()), 0.5)),
        ("generator", lambda w: f()(w.model.parameters(), 0.5, 1.0)),
        ("keywords", lambda w: f()(parameters=w.model.parameters(), max_norm=0.5, norm_type=2.0)),
        ("mixed", lambda w: f()(w.model.parameters(), max_norm=0.5, foreach=False)),
        ("one tensor", lambda w: f()(next(w.model.parameters()), 0.01, error_if_nonfinite=True)),
    ]


def _clip_value(owner: Any) -> list[tuple[str, Callable[[World], Any]]]:
    f = lambda: owner.clip_grad_value_  # noqa: E731
    return [
        ("positional", lambda w: f()(list(w.model.parameters()), 0.01)),
        ("keywords", lambda w: f()(parameters=w.model.parameters(), clip_value=0.01)),
        ("mixed", lambda w: f()(w.model.parameters(), clip_value=0.01, foreach=True)),
    ]


def _clip_with_norm(owner: Any) -> list[tuple[str, Callable[[World], Any]]]:
    f = lambda: owner.clip_grads_with_norm_  # noqa: E731
    norm = lambda w: torch.nn.utils.get_total_norm([p.grad for p in w.model.parameters()])  # noqa: E731
    return [
        ("positional", lambda w: f()(list(w.model.parameters()), 0.5, norm(w))),
        (
            "keywords",
            lambda w: f()(parameters=w.model.parameters(), max_norm=0.5, total_norm=norm(w)),
        ),
        ("mixed", lambda w: f()(w.model.parameters(), 0.5, total_norm=norm(w), foreach=False)),
    ]


def _sched(make: Callable[[torch.optim.Optimizer], Any]) -> Callable[[], World]:
    return lambda: _with_grads(_world(make), scaled=False)


# (owner, name) -> (fresh world, [(label, call)])
CASES: dict[tuple[Any, str], tuple[Callable[[], World], list[tuple[str, Callable[[World], Any]]]]]
CASES = {
    (GradScaler, "scale"): (
        _world,
        [
            ("positional", lambda w: w.scaler.scale(w.loss)),
            ("keyword", lambda w: w.scaler.scale(outputs=w.loss)),
            ("unbound", lambda w: GradScaler.scale(w.scaler, outputs=[w.loss, w.loss * 2])),
        ],
    ),
    (GradScaler, "unscale_"): (
        lambda: _with_grads(_world()),
        [
            ("positional", lambda w: w.scaler.unscale_(w.optimizer)),
            ("keyword", lambda w: w.scaler.unscale_(optimizer=w.optimizer)),
        ],
    ),
    (GradScaler, "step"): (
        lambda: _with_grads(_world()),
        [
            ("positional", lambda w: w.scaler.step(w.optimizer)),
            ("keyword", lambda w: w.scaler.step(optimizer=w.optimizer)),
            ("closure keyword", lambda w: w.scaler.step(w.optimizer, closure=None)),
            ("extra positional", lambda w: w.scaler.step(w.optimizer, None)),
        ],
    ),
    (GradScaler, "update"): (
        lambda: _with_grads(_world()),
        [
            ("none", lambda w: (w.scaler.step(w.optimizer), w.scaler.update())),
            ("positional", lambda w: (w.scaler.step(w.optimizer), w.scaler.update(8.0))),
            ("keyword", lambda w: (w.scaler.step(w.optimizer), w.scaler.update(new_scale=8.0))),
        ],
    ),
    (torch.autograd, "backward"): (
        _world,
        [
            ("positional", lambda w: torch.autograd.backward(w.loss)),
            ("method", lambda w: w.loss.backward(torch.tensor(2.0), True)),
            (
                "keywords",
                lambda w: torch.autograd.backward(
                    tensors=[w.loss], grad_tensors=[torch.tensor(0.5)], retain_graph=False
                ),
            ),
            (
                "inputs",
                lambda w: w.loss.backward(inputs=[next(w.model.parameters())]),
            ),
        ],
    ),
    (torch.nn.utils, "clip_grad_norm_"): (
        lambda: _with_grads(_world()),
        _clip_norm(torch.nn.utils),
    ),
    (torch.nn.utils, "clip_grad_value_"): (
        lambda: _with_grads(_world()),
        _clip_value(torch.nn.utils),
    ),
    (torch.nn.utils, "clip_grads_with_norm_"): (
        lambda: _with_grads(_world()),
        _clip_with_norm(torch.nn.utils),
    ),
    (torch.nn.utils.clip_grad, "clip_grad_norm_"): (
        lambda: _with_grads(_world()),
        _clip_norm(torch.nn.utils.clip_grad),
    ),
    (torch.nn.utils.clip_grad, "clip_grad_value_"): (
        lambda: _with_grads(_world()),
        _clip_value(torch.nn.utils.clip_grad),
    ),
    (torch.optim.Optimizer, "zero_grad"): (
        lambda: _with_grads(_world()),
        [
            ("default", lambda w: w.optimizer.zero_grad()),
            ("positional", lambda w: w.optimizer.zero_grad(False)),
            ("keyword", lambda w: w.optimizer.zero_grad(set_to_none=False)),
        ],
    ),
    (nn.Module, "zero_grad"): (
        lambda: _with_grads(_world()),
        [
            ("default", lambda w: w.model.zero_grad()),
            ("positional", lambda w: w.model.zero_grad(False)),
            ("keyword", lambda w: w.model.zero_grad(set_to_none=False)),
        ],
    ),
    (lr_scheduler.LRScheduler, "step"): (
        _sched(lambda o: lr_scheduler.StepLR(o, step_size=1, gamma=0.5)),
        [
            ("default", lambda w: (w.optimizer.step(), w.scheduler.step())),
            ("epoch positional", lambda w: w.scheduler.step(3)),
            ("epoch keyword", lambda w: w.scheduler.step(epoch=3)),
        ],
    ),
    (lr_scheduler.SequentialLR, "step"): (
        _sched(
            lambda o: lr_scheduler.SequentialLR(
                o,
                [lr_scheduler.ConstantLR(o, factor=0.5), lr_scheduler.ExponentialLR(o, 0.9)],
                milestones=[1],
            )
        ),
        [("default", lambda w: (w.optimizer.step(), w.scheduler.step(), w.scheduler.step()))],
    ),
    (lr_scheduler.ChainedScheduler, "step"): (
        _sched(
            lambda o: lr_scheduler.ChainedScheduler(
                [lr_scheduler.ConstantLR(o, factor=0.5), lr_scheduler.ExponentialLR(o, 0.9)]
            )
        ),
        [("default", lambda w: (w.optimizer.step(), w.scheduler.step()))],
    ),
    (lr_scheduler.ReduceLROnPlateau, "step"): (
        _sched(lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0)),
        [
            ("positional", lambda w: [w.scheduler.step(1.0) for _ in range(3)]),
            ("keyword", lambda w: [w.scheduler.step(metrics=1.0) for _ in range(3)]),
            ("mixed", lambda w: w.scheduler.step(torch.tensor(2.0), epoch=4)),
        ],
    ),
    (lr_scheduler.CosineAnnealingWarmRestarts, "step"): (
        _sched(lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2)),
        [
            ("default", lambda w: (w.optimizer.step(), w.scheduler.step())),
            ("positional", lambda w: w.scheduler.step(1.5)),
            ("keyword", lambda w: w.scheduler.step(epoch=0.5)),
        ],
    ),
}


def _label(owner: Any, name: str) -> str:
    return f"{getattr(owner, '__name__', owner)}.{name}"


def test_every_patched_callable_has_a_case() -> None:
    patched = {(owner, name) for owner, name, _ in patches.targets()}
    assert patched == set(CASES), "a new patch needs its transparency case here"


def _run(make: Callable[[], World], call: Callable[[World], Any]) -> tuple[Any, Any, bytes]:
    world = make()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result: Any = call(world)
        error = None
    except Exception as raised:  # the same error, with and without fpaudit
        result, error = None, (type(raised), str(raised))
    told = [(type(w.message), str(w.message)) for w in caught]
    return (result, error, told), world, _state(world)


@pytest.mark.parametrize(
    ("key", "label"),
    [(key, label) for key, (_, calls) in CASES.items() for label, _ in calls],
    ids=lambda v: v if isinstance(v, str) else _label(*v),
)
def test_a_patched_call_returns_and_does_what_the_original_does(key: Any, label: str) -> None:
    make, calls = CASES[key]
    call = dict(calls)[label]
    (plain, plain_error, plain_told), _, plain_state = _run(make, call)
    monitor = TrainingMonitor(RunOptions(capture_every=0))
    with monitor.installed():
        owner, name = key
        assert hasattr(vars(owner)[name], "__wrapped__")  # the patched one is called
        (watched, watched_error, watched_told), _, watched_state = _run(make, call)
    assert watched_error == plain_error
    assert watched_told == plain_told
    assert watched_state == plain_state  # parameters, grads, scaler, scheduler: bit for bit
    plain_items = plain if isinstance(plain, tuple | list) else (plain,)
    watched_items = watched if isinstance(watched, tuple | list) else (watched,)
    assert len(plain_items) == len(watched_items)
    for a, b in zip(plain_items, watched_items, strict=True):
        if isinstance(a, list):  # scale() of a list returns a list of tensors
            assert all(_same(x, y) for x, y in zip(a, b, strict=True))
        else:
            assert _same(a, b)


def test_patched_callables_keep_the_originals_signature_and_are_put_back() -> None:
    originals = {(o, n): vars(o)[n] for o, n, _ in patches.targets()}
    with TrainingMonitor().installed():
        for (owner, name), original in originals.items():
            patched = vars(owner)[name]
            assert patched is not original
            assert patched.__wrapped__ is original
            assert inspect.signature(patched) == inspect.signature(original)
            assert patched.__doc__ == original.__doc__ and patched.__name__ == original.__name__
        assert isinstance(vars(torch.Tensor)["grad"], property)
    assert all(vars(o)[n] is f for (o, n), f in originals.items())
    assert "grad" not in vars(torch.Tensor)


def test_a_call_the_original_rejects_fails_with_torchs_own_error() -> None:
    def error_of(call: Callable[[], Any]) -> str:
        with pytest.raises(TypeError) as raised:
            call()
        return str(raised.value)

    plain = error_of(lambda: torch.nn.utils.clip_grad_norm_([], limit=1.0))
    with TrainingMonitor().installed():
        watched = error_of(lambda: torch.nn.utils.clip_grad_norm_([], limit=1.0))
    assert watched == plain


def test_tensor_grad_reads_writes_and_deletes_as_before() -> None:
    world = _with_grads(_world(), scaled=False)
    param = next(world.model.parameters())
    expected = param.grad.clone()
    with TrainingMonitor().installed():
        assert torch.equal(param.grad, expected)
        param.grad = torch.ones_like(expected)
        assert torch.equal(param.grad, torch.ones_like(expected))
        del param.grad
        assert param.grad is None
        param.grad = expected
    assert param.grad is expected


def test_an_error_in_fpaudits_own_handler_is_reported_as_fpaudits(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import contextmanager

    from fpaudit.run.training import run_script

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "p = torch.nn.Parameter(torch.ones(2))\n"
        "p.sum().backward()\n"
        "try:\n"
        "    torch.nn.utils.clip_grad_norm_([p], max_norm=1.0)\n"
        "except Exception:\n"
        "    print('the script swallowed it')\n"
    )

    @contextmanager
    def broken(self: Any, call: Any) -> Any:
        raise ZeroDivisionError("a bug in the monitor")
        yield

    monkeypatch.setattr(TrainingMonitor, "on_clip", broken)
    with pytest.raises(RuntimeError) as raised:
        run_script(script)
    message = str(raised.value)
    assert "fpaudit's training monitor failed" in message
    assert "ZeroDivisionError: a bug in the monitor" in message
    assert f"{script}:5" in message and "not in train.py" in message


# -- the Hugging Face callback's wrappers (fpaudit.integrations.huggingface) --------------
def _hf_callback(tmp_path: Any) -> Any:
    pytest.importorskip("transformers", reason="needs transformers")
    from fpaudit.integrations.huggingface import FpauditTrainerCallback

    callback = FpauditTrainerCallback(out=tmp_path / "report", force=True)
    callback.session.start(nn.Linear(2, 1), 0)
    return callback


_HF_CASES = [
    (key, label)
    for key, (_, calls) in CASES.items()
    if key[1]
    in {"backward", "clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "unscale_"}
    for label, _ in calls
]


def test_every_hf_wrapper_has_a_case(tmp_path: Any) -> None:
    callback = _hf_callback(tmp_path)
    world = _with_grads(_world())
    callback._scaler = world.scaler
    wrapped = {
        (o if o is not world.scaler else GradScaler, n) for o, n, _ in callback.patch_targets()
    }
    assert wrapped == {key for key, _ in _HF_CASES}


@pytest.mark.parametrize(
    ("key", "label"), _HF_CASES, ids=lambda v: v if isinstance(v, str) else _label(*v)
)
def test_an_hf_wrapped_call_returns_and_does_what_the_original_does(
    key: Any, label: str, tmp_path: Any
) -> None:
    make, calls = CASES[key]
    call = dict(calls)[label]
    (plain, plain_error, plain_told), _, plain_state = _run(make, call)

    def watched_world() -> World:
        world = make()
        callback._scaler = world.scaler
        callback.session.begin(0)  # open: the first clip or unscale_ closes the step
        callback._install()
        owner = world.scaler if key[0] is GradScaler else key[0]
        patched = getattr(owner, key[1])
        assert patched.__wrapped__ is not None  # the wrapper is what gets called
        assert inspect.signature(patched) == inspect.signature(patched.__wrapped__)
        return world

    callback = _hf_callback(tmp_path)
    try:
        (watched, watched_error, watched_told), _, watched_state = _run(watched_world, call)
    finally:
        callback._patches.restore()
        callback.session.abort()
    assert watched_error == plain_error
    assert watched_told == plain_told
    assert watched_state == plain_state
    plain_items = plain if isinstance(plain, tuple | list) else (plain,)
    watched_items = watched if isinstance(watched, tuple | list) else (watched,)
    assert len(plain_items) == len(watched_items)
    for a, b in zip(plain_items, watched_items, strict=True):
        if isinstance(a, list):
            assert all(_same(x, y) for x, y in zip(a, b, strict=True))
        else:
            assert _same(a, b)
    assert not callback._patches  # every wrapper put back
    assert not hasattr(vars(torch.autograd)["backward"], "__wrapped__")


# -- the other replacements: the capture's engine entry, the model file's os._exit ------
def _engine_calls(create_graph: bool) -> list[tuple[str, Callable[[Any, Any, Any], Any]]]:
    """Calls of ``torch.autograd._engine_run_backward`` as torch makes them (positional,
    keywords last) and as the engine's own keyword names allow."""
    c = create_graph
    f = lambda: torch.autograd._engine_run_backward  # noqa: E731 (read at call time)
    return [
        ("positional", lambda o, g, x: f()((o,), (g,), False, c, (), True, True)),
        (
            "as torch.autograd.backward",
            lambda o, g, x: f()(
                (o,), (g,), False, c, (), allow_unreachable=True, accumulate_grad=True
            ),
        ),
        (
            "keywords",
            lambda o, g, x: f()(
                t_outputs=(o,),
                grad_tensors=(g,),
                keep_graph=False,
                create_graph=c,
                inputs=(x,),
                allow_unreachable=True,
                accumulate_grad=False,
            ),
        ),
        (
            "mixed",
            lambda o, g, x: f()(
                (o,), (g,), keep_graph=False, create_graph=c, inputs=(x,), accumulate_grad=False
            ),
        ),
    ]


ENGINE_CASES = [(c, label) for c in (False, True) for label, _ in _engine_calls(c)]


def _engine_world() -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3, requires_grad=True)
    return model, model(x).pow(2).sum(), torch.tensor(1.0), x


@pytest.mark.parametrize(("create_graph", "label"), ENGINE_CASES, ids=str)
def test_the_capture_finds_create_graph_however_the_engine_is_called(
    create_graph: bool, label: str
) -> None:
    from fpaudit.capture.audit import Audit

    call = dict(_engine_calls(create_graph))[label]

    def outcome(model: Any, out: Any, grad: Any, x: Any) -> tuple[Any, ...]:
        result = call(out, grad, x)
        grads = [p.grad for p in model.parameters()] + [x.grad]
        return result, [g.detach() if g is not None else None for g in grads]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_graph=True in backward(): torch's leak warning
        plain_result, plain_grads = outcome(*_engine_world())
        model, out, grad, x = _engine_world()
        seen: list[bool] = []
        with Audit(model) as audit:
            patched = torch.autograd._engine_run_backward
            assert patched.__wrapped__ is not None  # the capture's wrapper is called
            mode = audit._mode
            assert mode is not None
            observe = mode._observe

            context = audit._context

            def spy(*args: Any) -> None:
                seen.append(context.grad_mode_means_recompute)
                observe(*args)

            mode._observe = spy  # type: ignore[method-assign]
            watched_result, watched_grads = outcome(model, out, grad, x)
            recorded = audit.seen_ops()
    assert seen and set(seen) == {not create_graph}  # create_graph, wherever it was given
    assert recorded  # with create_graph, backward runs with grad mode on: still recorded
    plain_items, watched_items = plain_result or (), watched_result or ()  # None: into .grad
    assert (plain_result is None) == (watched_result is None)
    for a, b in zip([*plain_items, *plain_grads], [*watched_items, *watched_grads], strict=True):
        assert (a is None and b is None) or _same(a, b)


def test_the_engine_wrapper_keeps_the_originals_signature_and_is_put_back() -> None:
    from fpaudit.capture.audit import Audit

    original = torch.autograd._engine_run_backward
    with Audit(nn.Linear(2, 1)):
        patched = torch.autograd._engine_run_backward
        assert patched is not original and patched.__wrapped__ is original
        assert inspect.signature(patched) == inspect.signature(original)
        assert patched.__name__ == original.__name__ and patched.__doc__ == original.__doc__
    assert torch.autograd._engine_run_backward is original


def test_os_exit_under_a_model_file_takes_the_calls_os_exit_takes() -> None:
    import os

    from fpaudit.run.modelfile import HardExit, exits_caught

    def error_of(call: Callable[[], Any]) -> tuple[type, str]:
        try:
            call()
        except TypeError as error:  # a call os._exit rejects never exits, patched or not
            return type(error), str(error)
        raise AssertionError("expected a TypeError")

    rejected: list[Callable[[], Any]] = [
        lambda: os._exit(),
        lambda: os._exit(state=3),
        lambda: os._exit(3, 4),
        lambda: os._exit(3.0),
        lambda: os._exit("3"),
    ]
    plain = [error_of(call) for call in rejected]
    real = os._exit
    with exits_caught():
        assert os._exit is not real and os._exit.__wrapped__ is real  # type: ignore[attr-defined]
        assert inspect.signature(os._exit) == inspect.signature(real)
        assert os._exit.__name__ == real.__name__ and os._exit.__doc__ == real.__doc__
        assert [error_of(call) for call in rejected] == plain
        # os._exit takes its status by position or by keyword (its signature says so)
        for call in (lambda: os._exit(3), lambda: os._exit(status=3), lambda: os._exit(True)):
            with pytest.raises(HardExit) as exited:
                call()
            assert exited.value.code in (3, True)
    assert os._exit is real
