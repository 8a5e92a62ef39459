"""Provenance: which backward values do not scale with the loss (:class:`Provenance`),
followed through storages, not tensor objects, and decided per op by the dispatch mode
(``fpaudit.capture.mode``)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fpaudit.capture.oprules import NO_STORAGE as _NO_STORAGE
from fpaudit.capture.oprules import storage_of
from fpaudit.capture.origin_probe import tensors_in

_Tensor = torch.Tensor
# Dtypes whose values cannot carry a loss scale (indices, masks, counters).
UNSCALABLE = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


class _StorageRef(weakref.ref[torch.UntypedStorage]):
    """A weak reference to a fixed storage that knows its key (the storage's id) for
    its callback: made for each newly marked storage (saved values detached in backward
    make new ones every step), cheaper than a reference and a ``functools.partial``."""

    __slots__ = ("key",)
    key: int


class Provenance:
    """Which backward values do not scale with the loss ("fixed" values).

    Loss scaling multiplies the gradient flowing backward, not the forward
    values that backward formulas read from saved tensors. ``pow``'s backward,
    for one, computes ``2 * x`` from the saved input before multiplying by the
    incoming gradient; that intermediate stays put whatever the scale.

    The rule follows data, not tensor objects. Saved forward values and
    parameters reach backward with ``requires_grad=True``; everything backward
    creates has ``requires_grad=False`` (unless ``create_graph``). A floating
    tensor is fixed when it requires grad or its *storage* is marked fixed; an
    op's outputs are fixed when none of its floating inputs is scaled (integer
    and bool inputs, indices and masks, carry no scale), and their storages are
    then marked. An op that writes in place with a scaled input (``add_``,
    ``copy_``, ``index_put_``, through any view) unmarks the storage it wrote,
    so a zero buffer filled through ``select``/``slice`` views with gradients
    (``pack_padded_sequence``'s backward) is scaled, and so is everything read
    from it. Fixed storages are rare and remembered here by weak reference
    (Python keeps one object per storage, shared by all its views).
    """

    def __init__(self) -> None:
        self._fixed: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._on_death = self._forget  # one bound method for every reference

    def _forget(self, ref: _StorageRef) -> None:
        key = ref.key
        if self._fixed.get(key) is ref:  # not a newer storage that reused the id
            del self._fixed[key]

    def is_fixed(self, tensor: torch.Tensor) -> bool:
        if tensor.requires_grad or tensor.dtype in UNSCALABLE:
            return True
        if not self._fixed:
            return False
        try:  # storage_of, inlined: this runs for most backward ops
            storage = tensor.untyped_storage()
        except _NO_STORAGE:
            storage = None
        ref = self._fixed.get(id(storage))
        return ref is not None and ref() is storage

    def all_fixed(self, tensors: Iterable[Any]) -> bool:
        """Whether every tensor among ``tensors`` is fixed (anything else in it, a Python
        number at a tensor argument's place, carries no scale)."""
        fixed = self._fixed
        unscalable = UNSCALABLE
        for tensor in tensors:  # is_fixed, inlined: this runs for every backward op
            if (
                not isinstance(tensor, _Tensor)
                or tensor.requires_grad
                or tensor.dtype in unscalable
            ):
                continue
            if not fixed:  # the common case: no storage lookups
                return False
            try:
                storage = tensor.untyped_storage()
            except _NO_STORAGE:
                storage = None
            ref = fixed.get(id(storage))
            if ref is None or ref() is not storage:
                return False
        return True

    def mark_output(self, output: Any) -> None:
        """Mark the storages of an op's output tensors (one tensor, or a list of them)."""
        if type(output) is _Tensor:
            self.mark_one(output)
        else:
            self.mark(tensors_in(output))

    def mark(self, tensors: Iterator[torch.Tensor]) -> None:
        for tensor in tensors:
            self.mark_one(tensor)

    def mark_one(self, tensor: torch.Tensor) -> None:
        storage = storage_of(tensor)
        key = id(storage)
        if storage is not None and key not in self._fixed:
            ref = self._fixed[key] = _StorageRef(storage, self._on_death)
            ref.key = key

    def has_fixed(self) -> bool:
        return bool(self._fixed)

    def unmark(self, tensors: Iterator[torch.Tensor]) -> None:
        for tensor in tensors:
            self._fixed.pop(id(storage_of(tensor)), None)

    def clear(self) -> None:
        self._fixed.clear()
