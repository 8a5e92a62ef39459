"""The Audit's explicit lifecycle: open(), close(), close(discard=True).

Callers that drop an open step (``fpaudit run``, the framework integrations) call
``close(discard=True)`` instead of faking an exception through ``__exit__``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fpaudit.capture.audit import Audit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def _backward(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)  # every step alike: no accumulation ops
    model(torch.randn(5, 3)).pow(2).mean().backward()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_open_installs_and_close_removes_the_hooks() -> None:
    model = _model()
    before = _hooks(model)
    audit = Audit(model)
    assert not audit.is_open
    assert audit.open() is audit
    assert audit.is_open and _hooks(model) > before
    audit.close()
    assert not audit.is_open and _hooks(model) == before
    assert _get_current_dispatch_mode() is None


def _global_registration_hooks() -> int:
    module = nn.modules.module
    return len(module._global_parameter_registration_hooks) + len(
        module._global_module_registration_hooks
    )


def test_the_last_audit_to_close_removes_torchs_global_registration_hooks() -> None:
    before = _global_registration_hooks()
    first, second = Audit(_model()), Audit(_model())
    first.open()
    second.open()
    assert _global_registration_hooks() == before + 2  # one pair, however many audits
    first.close()
    assert _global_registration_hooks() == before + 2  # the second still watches
    second.close()
    assert _global_registration_hooks() == before


def test_a_parameter_registered_while_no_audit_is_open_is_recorded_after_reopening() -> None:
    """While no audit watches, registrations go unseen: an audit opened again (as
    ``fpaudit run`` reopens its audit for each captured step) must walk the model's
    parameters again, not reuse the walk it made before."""
    model = _model()
    audit = Audit(model)
    with audit:
        _backward(model)
        audit.step()
    model[0].extra = nn.Parameter(torch.ones(2))  # registered while nothing watched
    with audit:
        model.zero_grad(set_to_none=True)
        (model(torch.randn(5, 3)).pow(2).mean() + model[0].extra.sum()).backward()
        audit.step()
    records = audit.report.records
    grads = records[(records["kind"] == "grad") & (records["step"] == 1)]
    assert ("0", "extra") in set(zip(grads["module"], grads["op"], strict=True)), grads


def test_close_records_the_open_step_and_discard_drops_it() -> None:
    model = _model()
    audit = Audit(model)
    audit.open()
    _backward(model)
    audit.close()  # records still open: closed as one step
    assert audit.steps == 1
    kept = audit.step_rows()["records"]
    assert len(kept) == 1 and kept[0] > 0
    audit.open()
    _backward(model)
    audit.close(discard=True)  # dropped: nothing of it is recorded
    assert audit.steps == 1
    assert audit.step_rows()["records"] == kept
    audit.open()  # the dropped step's records do not leak into the next step
    _backward(model)
    audit.close()
    assert audit.steps == 2 and audit.step_rows()["records"] == kept * 2


def test_closing_twice_or_without_opening_does_nothing() -> None:
    model = _model()
    audit = Audit(model)
    audit.close()
    audit.close(discard=True)
    assert audit.steps == 0 and not audit.is_open
    audit.open()
    _backward(model)
    audit.close()
    audit.close()  # a second close does not record a second step
    audit.close(discard=True)
    assert audit.steps == 1


def test_opening_an_open_audit_is_refused_and_leaves_it_open() -> None:
    model = _model()
    audit = Audit(model)
    audit.open()
    hooks = _hooks(model)
    with pytest.raises(RuntimeError, match="already open"):
        audit.open()
    assert audit.is_open and _hooks(model) == hooks  # not installed twice
    audit.close()


def test_the_context_manager_is_open_and_close_discarding_on_an_exception() -> None:
    model = _model()
    audit = Audit(model)
    with audit:
        _backward(model)
    assert audit.steps == 1
    with pytest.raises(ZeroDivisionError), audit:
        _backward(model)
        raise ZeroDivisionError
    assert audit.steps == 1 and not audit.is_open


def test_a_discarded_step_leaves_no_block_statistics_in_the_next() -> None:
    """The twin is an audit that never saw the discarded step: the kept step's block
    statistics (counts, blocks, scale codes) equal its own exactly. The discarded step's
    values (x 2^-10) land in other scale codes, so a leak would show."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(8, 64)

    def kept_step(audit: Audit) -> None:
        with audit:
            model.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            audit.step(loss=loss)

    twin = Audit(model, recipes=["mxfp8-e4m3"])
    kept_step(twin)
    audit = Audit(model, recipes=["mxfp8-e4m3"])
    audit.open()
    model.zero_grad()
    model(x * 2.0**-10).pow(2).mean().backward()
    audit.close(discard=True)
    kept_step(audit)
    expected, got = twin.report.blocks, audit.report.blocks
    assert len(got) == len(expected) > 0 and got["blocks"].sum() > 0
    assert got.drop(columns="step").equals(expected.drop(columns="step"))


def test_audit_takes_exactly_audits_parameters_which_help_shows() -> None:
    import inspect
    import pydoc

    import fpaudit

    own = inspect.signature(fpaudit.audit)
    assert list(own.parameters.values()) == list(inspect.signature(Audit).parameters.values())
    assert list(own.parameters) == [
        "model", "loss_scale", "selection", "window", "shadow", "origins", "recipes",
        "module_hooks", "name_nonfinite",
    ]  # fmt: skip
    assert own.return_annotation == "Audit"
    shown = pydoc.render_doc(fpaudit.audit, renderer=pydoc.plaintext)
    assert "audit(model: 'nn.Module', *, loss_scale: 'float' = 1.0," in shown
    assert "Audit the backward pass of ``model``" in shown
    made = fpaudit.audit(_model(), window=2, shadow=True)
    assert isinstance(made, Audit) and made._context.shadow and made._builder.window == 2
    with pytest.raises(TypeError, match="nope"):
        fpaudit.audit(_model(), nope=1)  # type: ignore[call-arg]
