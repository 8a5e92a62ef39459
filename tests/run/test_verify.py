"""fpaudit/run/verify.py called directly, on a model whose fp16 gradients are known exactly.

One bias-free ``Linear(4, 1)`` with weight 1 and input ``x``; the loss is
``2**-10 * sum(model(x))``, so the fp32 weight gradient is exactly ``2**-10 * x``. Under
fp16 autocast the weight gradient is the fp16 product of the incoming gradient
``S * 2**-10`` and ``x`` (both exact in fp16): at S = 1 an element ``2**-20`` of x gives
``2**-30``, below half fp16's smallest subnormal (``2**-25``), so it rounds to zero; at
S = 2**10 it is ``2**-20``, exact, and unscaling recovers ``2**-30`` exactly. The loss is
fp16 (autocast's Linear output, summed and scaled in fp16), so at S = 2**20 > 65504 the
seed itself is inf: the gradients are not finite and the step is skipped. SGD's learning
rate 2**20 makes a ``2**-30`` gradient move a weight of 1 visibly in fp32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fpaudit.errors import OptionError
from fpaudit.run.verify import verify

MODEL = """import torch
from torch import nn

def model():
    net = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    return net

batches = [torch.tensor([{x}])]

def loss(model, x):
    return model(x).sum() * 2.0**-10

def optimizer(params):
    return torch.optim.SGD(params, lr=2.0**20)  # a 2**-30 gradient moves 1.0
"""
TINY = 2.0**-20


def _model(tmp_path: Path, x: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(x=x))
    return path


def test_a_gradient_below_fp16s_range_is_lost_at_s_1(tmp_path: Path) -> None:
    result = verify(_model(tmp_path, f"{TINY!r}, {TINY!r}, 1.0, 0.0"), log2_scale=0, device="cpu")
    (weight,) = result.parameters
    assert (weight.name, weight.elements, weight.nonzero, weight.zeroed) == ("weight", 4, 3, 2)
    assert weight.zeroed_fraction == 2 / 3 and result.lost_fraction == 2 / 3
    assert weight.changed_fp32 and weight.changed_mixed  # the element 1.0 still moves it
    assert not result.skipped and result.passed and result.reasons == []
    # the mixed gradient is (0, 0, 2**-10, 0) against (2**-30, 2**-30, 2**-10, 0)
    reference = math.sqrt(2 * 2.0**-60 + 2.0**-20)
    assert weight.relative_error == pytest.approx(math.sqrt(2) * 2.0**-30 / reference, rel=1e-6)
    assert result.grad_norm_fp32 == pytest.approx(reference, rel=1e-6)
    assert result.grad_norm_mixed == 2.0**-10
    assert (result.scale, result.log2_scale, result.amp, result.optimizer) == (
        1.0,
        0,
        "fp16",
        "SGD",
    )
    assert result.reference_nonzero == 3 and result.reference_finite


def test_a_parameter_whose_whole_gradient_is_lost_stalls(tmp_path: Path) -> None:
    result = verify(_model(tmp_path, ", ".join([repr(TINY)] * 4)), log2_scale=0, device="cpu")
    (weight,) = result.parameters
    assert weight.zeroed == weight.nonzero == 4 and weight.relative_error == 1.0
    assert weight.changed_fp32 and not weight.changed_mixed
    assert result.stalled == ["weight"] and not result.passed
    assert result.reasons == ["these parameters change in fp32 but not in fp16: weight"]
    assert weight.update_error == 1.0  # the fp32 step moved it, the mixed one did not


def test_the_right_scale_recovers_every_gradient_exactly(tmp_path: Path) -> None:
    result = verify(_model(tmp_path, ", ".join([repr(TINY)] * 4)), log2_scale=10, device="cpu")
    (weight,) = result.parameters
    assert weight.zeroed == 0 and weight.relative_error == 0.0 and weight.update_error == 0.0
    assert result.grad_norm_mixed == result.grad_norm_fp32 == 2 * 2.0**-30
    assert result.passed and result.scale == 1024.0


def test_an_overflowing_scale_skips_the_step(tmp_path: Path) -> None:
    result = verify(_model(tmp_path, f"{TINY!r}, 1.0, 1.0, 1.0"), log2_scale=20, device="cpu")
    assert result.skipped and not result.passed
    assert result.reasons == [
        "the fp16 step was skipped: its gradients held inf or NaN at this scale",
        "these parameters change in fp32 but not in fp16: weight",
    ]
    assert not math.isfinite(result.grad_norm_mixed)
    data = result.to_dict()
    assert data["grad_norm_mixed"] is None and data["passed"] is False
    json.dumps(data, allow_nan=False)  # inf and NaN are None: strict JSON


def test_a_reference_without_evidence_fails(tmp_path: Path) -> None:
    zero = verify(_model(tmp_path, "0.0, 0.0, 0.0, 0.0"), log2_scale=0, device="cpu")
    assert zero.reference_nonzero == 0 and zero.lost_fraction == 0.0 and not zero.passed
    assert zero.reasons[0].startswith("measured nothing: no fp32 reference gradient")
    infinite = verify(_model(tmp_path, "float('inf'), 1.0, 1.0, 1.0"), log2_scale=0, device="cpu")
    assert not infinite.reference_finite and not infinite.passed
    assert infinite.reasons[0].startswith("the fp32 reference step holds inf or NaN")


@pytest.mark.parametrize(
    ("options", "option", "detail"),
    [
        ({"amp": "fp64"}, "amp", "must be one of fp16, bf16, got 'fp64'"),
        ({"clip_norm": 0.0}, "clip_norm", "must be a positive number, got 0.0"),
        ({"clip_norm": float("nan")}, "clip_norm", "must be a positive number, got nan"),
    ],
)
def test_bad_options_are_usage_errors(
    tmp_path: Path, options: dict, option: str, detail: str
) -> None:
    """The library names its own parameter (clip_norm); the CLI names the flag (--clip-norm)."""
    with pytest.raises(OptionError) as raised:
        verify(_model(tmp_path, "1.0, 1.0, 1.0, 1.0"), log2_scale=0, device="cpu", **options)
    error = raised.value
    assert (error.option, error.detail) == (option, detail)
    assert str(error) == f"{option} {detail}"
    assert error.as_flag() == f"--{option.replace('_', '-')} {detail}"
