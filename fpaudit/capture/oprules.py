"""What an aten op is, as the capture sees it: whether it makes new values or only
re-presents them (views, same-dtype copies, collectives), which tensors it wrote, which
operands a matrix multiply has, and whether an ``AccumulateGrad`` node's op works on the
gradient. Pure functions of an op and its arguments; the dispatch mode
(``fpaudit.capture.mode``) asks them for every op it sees."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from fpaudit import torch_internals as _internals
from fpaudit.capture.origin_probe import tensors_in as _tensors
from fpaudit.numerics.formats import FP32
from fpaudit.rules.origins import is_constant_op
from fpaudit.torch_internals import OpOverload

_aten = torch.ops.aten
# Ops that only copy, move or zero-pad values: their outputs hold no value
# that is not already in an input (when the dtype is kept). ``SplitBackward0``,
# for one, concatenates gradients that were recorded when they were made.
DATA_MOVEMENT = frozenset(
    {
        _aten.clone.default,
        _aten._unsafe_view.default,
        _aten.copy_.default,
        _aten._to_copy.default,
        _aten.lift_fresh_copy.default,
        _aten.cat.default,
        _aten.stack.default,
        _aten.slice_backward.default,
        _aten.select_backward.default,
        _aten.diagonal_backward.default,
        _aten.constant_pad_nd.default,
        _aten.repeat.default,
        _aten.flip.default,
        _aten.roll.default,
    }
)


# Ops whose outputs are not values of the computation: uninitialised buffers, and
# the collectives and copies of distributed wrappers (DDP's all-reduce of a gradient
# bucket, FSDP's all-gather of parameters for backward). Each rank records its own
# gradient values where they are computed; these would count them again, or count
# parameters and garbage as backward values.
_UNINITIALISED = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
_NOT_VALUES = frozenset({"c10d", "_c10d_functional", "fsdp", "_dtensor"})
# Matrix multiplies and where their two operands are in the arguments: the GEMMs whose
# operands a block-scaled recipe quantizes (Transformer Engine, torchao's MX/float8
# Linear). ``aten.linear`` reaches backward as these.
_GEMM_OPERANDS = {
    _aten.mm.default: (0, 1),
    _aten.addmm.default: (1, 2),
    _aten.bmm.default: (0, 1),
    _aten.baddbmm.default: (1, 2),
}


def gemm_operands(func: OpOverload, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The two operands of a matrix multiply (in the arguments), or [] for another op."""
    positions = _GEMM_OPERANDS.get(func)
    if positions is None:
        return []
    left, right = args[positions[0]], args[positions[1]]
    if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)):
        return []
    return [left, right]


def as_contracted(operand: torch.Tensor, index: int) -> torch.Tensor:
    """A GEMM operand with its contraction dimension last (the one a 1 x 32 block runs
    along, as frameworks quantize it): the left operand as it is, the right transposed."""
    return operand if index == 0 else operand.transpose(-1, -2)


ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"  # the node that adds into a parameter's .grad


def works_on_grad(
    func: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    node: Any,
) -> bool:
    """Whether an op run by an ``AccumulateGrad`` node works on its parameter's ``.grad``:
    adds into it (the node's own work) or changes it in place (a hook averaging it),
    rather than being a post-accumulate-grad hook's bookkeeping (an optimizer's or an
    average's state). FSDP1's hook on its flat parameter is gradient work: the padded,
    divided gradient it reduce-scatters is recorded."""
    if func.is_view or func in DATA_MOVEMENT:
        return True  # the first gradient, kept as is: nothing new to record anyway
    variable = getattr(node, "variable", None)
    if _internals.is_flat_param(variable):
        return True  # FSDP1's post-backward hook: padding and dividing the flat gradient
    grad = getattr(variable, "grad", None)
    if grad is None:
        return False
    target = storage_of(grad)
    if _internals.is_mutable(func):
        return any(storage_of(t) is target for t in written(func, args, kwargs, output))
    return func is _aten.add.Tensor and any(
        isinstance(a, torch.Tensor) and storage_of(a) is target for a in args
    )


def float_tensors(output: Any) -> Iterator[tuple[int, torch.Tensor]]:
    """The floating-point tensors among an op's outputs, by position. A complex tensor
    is given as its real and imaginary parts (``view_as_real``): two values of its
    component dtype per element, which is what a cast to a low-precision format keeps."""
    for index, tensor in enumerate(_tensors(output)):
        if tensor.layout != torch.strided or tensor.is_meta:
            continue
        if tensor.is_floating_point():
            yield index, tensor
        elif tensor.is_complex():
            yield index, torch.view_as_real(tensor.resolve_conj())


_IS_VIEW: dict[OpOverload, bool] = {}
_WRITTEN: dict[OpOverload, tuple[tuple[int, str], ...]] = {}


def written(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Iterator[torch.Tensor]:
    """The tensors a mutable op wrote: its outputs, and arguments its schema marks as
    written (``_foreach_*_`` ops return nothing)."""
    yield from _tensors(output)
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = _internals.written_arguments(func)
    for index, name in positions:
        value = args[index] if index < len(args) else kwargs.get(name)
        yield from _tensors(value)


@functools.cache
def constant_op(op: str) -> bool:
    """``is_constant_op``, remembered per op name (asked for every forward op)."""
    return is_constant_op(op)


def inputs_clean(
    args: tuple[Any, ...], outputs: list[torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """On ``device``, without a sync: does every floating input on it (an in-place op's
    target aside: it already holds the output) lie strictly inside float32's finite range?
    False for inf, NaN and ``torch.finfo(float32)`` mask sentinels; None: no such input."""
    clean: torch.Tensor | None = None
    for t in _tensors(args):
        if (
            not t.is_floating_point()
            or t.device != device
            or not t.numel()
            or t.layout != torch.strided
            or any(t is out for out in outputs)
        ):
            continue
        values = t.detach() if t.element_size() > 1 else t.detach().float()  # fp8: exact
        low, high = torch.aminmax(values)  # NaN makes both NaN: not inside
        inside = (high < FP32.max_finite) & (low > -FP32.max_finite)
        clean = inside if clean is None else clean & inside
    return clean


def creates_new_values(func: OpOverload, args: tuple[Any, ...], output: Any) -> bool:
    """False for ops that only re-present values: views, detach, same-dtype copies and moves."""
    is_view = _IS_VIEW.get(func)
    if is_view is None:
        is_view = _IS_VIEW[func] = (
            bool(func.is_view) or func in _UNINITIALISED or func.namespace in _NOT_VALUES
        )
    if is_view:
        return False
    if func in DATA_MOVEMENT:
        source = args[1] if func is _aten.copy_.default else next(_tensors(args), None)
        target = output if isinstance(output, torch.Tensor) else None
        return not (source is not None and target is not None and source.dtype == target.dtype)
    return True


NO_STORAGE = (RuntimeError, NotImplementedError, TypeError)  # untyped_storage() of none


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``tensor`` and all its views, or None for storage-less tensors."""
    try:
        return tensor.untyped_storage()
    except NO_STORAGE:
        return None
