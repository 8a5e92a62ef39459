"""The recording function (:meth:`Recorder.record`): every captured tensor goes to one
call with ``(kind, module, node, op, output_index, scales_with_loss, tensor)``. Its
values accumulate in a ``histogram.HistogramTable`` row on the tensor's device, one row
per record key, and nothing else is retained; closing a step brings each device's rows
to the host with one transfer (:meth:`Recorder.collect`)."""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fpaudit import torch_internals as _internals
from fpaudit.capture.clock import model_name, wrapped_paths
from fpaudit.capture.selection import Selection
from fpaudit.kernels import histogram
from fpaudit.kernels.blockstats import BlockRecorder
from fpaudit.report.records import (
    KIND_BACKWARD,
    KIND_GRAD,
    KIND_OPERAND,
    NonzeroBins,
    RecordKey,
    StepRecords,
)

Place = tuple[histogram.HistogramTable, int]
_Parameter = tuple[nn.Module | None, str, str, nn.Parameter]


class _Registrations:
    """Counts parameters and submodules registered on any module, through torch's global
    registration hooks, installed while any audit is open (:meth:`watching`: the first
    audit to open installs them, the last to close removes them, so no hook of fpaudit's
    stays in the process): a model's parameters are walked again only when the count
    moved. While nothing watches, registrations go unseen, so every count then is new."""

    def __init__(self) -> None:
        self._count = 0
        self._watchers = 0
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    def _bump(self, *_: object) -> None:
        self._count += 1

    @contextmanager
    def watching(self) -> Iterator[None]:
        with self._lock:
            if not self._watchers:
                self._count += 1  # what was registered while nothing watched is unknown
                module_hooks = nn.modules.module
                self._handles = [
                    module_hooks.register_module_parameter_registration_hook(self._bump),
                    module_hooks.register_module_module_registration_hook(self._bump),
                ]
            self._watchers += 1
        try:
            yield
        finally:
            with self._lock:
                self._watchers -= 1
                if not self._watchers:
                    handles, self._handles = self._handles, []
                    for handle in handles:
                        handle.remove()

    def count(self) -> int:
        if not self._watchers:
            self._count += 1
        return self._count


_registrations = _Registrations()


def registrations_watched() -> AbstractContextManager[None]:
    """While open, count module registrations for the parameter walks' cache (an open
    audit holds one; torch's global hooks are removed when the last one closes)."""
    return _registrations.watching()


_NEW: Any = object()  # not looked up yet (a key's place is a pair, or None)
_CPU = torch.device("cpu")


class _GradPlan:
    """A model's parameters (``Recorder._parameters``' entries) as closing a step reads
    them: their gradients' rows in the CPU table and the dtype each row is for
    (``histogram.UNPLANNED`` until a plain CPU gradient was seen), and what tells
    whether each parameter is still its owner's attribute (:meth:`owners_hold`)."""

    def __init__(self, entries: list[_Parameter]) -> None:
        self.entries = entries
        self.params = [entry[3] for entry in entries]
        self.rows = [histogram.UNPLANNED] * len(entries)
        self.dtypes = [torch.float32] * len(entries)
        self._owners: list[Any] = [entry[0] for entry in entries]
        self._leaves = [entry[1] for entry in entries]
        # every parameter in its owner's parameter dict (the usual case): checked there
        self._in_dicts = all(
            owner is not None and _internals.parameters_of(owner).get(leaf) is param
            for owner, leaf, param in zip(self._owners, self._leaves, self.params, strict=True)
        )

    def owners_hold(self) -> bool:
        """Whether each parameter is still its owner's attribute (``getattr(owner, leaf)
        is param``; owner None: found by no owner, not checked): a swap straight into the
        owner's parameters passes no hook. Read in the owners' parameter dicts, where
        ``Module.__getattr__`` finds a parameter, when every one was there."""
        if self._in_dicts:
            found = map(dict.get, map(_internals.parameters_of, self._owners), self._leaves)
            return all(map(operator.is_, found, self.params))
        return all(
            owner is None or getattr(owner, leaf, None) is param
            for owner, leaf, param in zip(self._owners, self._leaves, self.params, strict=True)
        )


class _ParameterWalk:
    """A model's parameters with their owners, walked again only when they may have
    changed (:meth:`of`)."""

    def __init__(self) -> None:
        # (model, registrations count, its parameters)
        self._cached: tuple[nn.Module, int, list[_Parameter]] | None = None

    def forget(self) -> None:
        self._cached = None

    def of(self, model: nn.Module) -> list[_Parameter]:
        """``model.named_parameters()`` as (owning module, attribute, name, parameter),
        kept between steps while no module registered a parameter or a submodule
        (torch's global registration hooks count them) and each is still its owner's
        attribute (checked at each use: a swap straight into the owner's parameters
        passes no hook). Owner None: not found by its name (a wrapper's own naming);
        such a model is walked every step."""
        version = _registrations.count()
        cached = self._cached
        if cached is not None and cached[0] is model and cached[1] == version:
            return cached[2]
        entries: list[_Parameter] = []
        wrapped = wrapped_paths(model)
        for name, param in model.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            try:
                owner: nn.Module | None = model.get_submodule(prefix) if prefix else model
            except AttributeError:
                owner = None
            if owner is not None and getattr(owner, leaf, None) is not param:
                owner = None
            if wrapped:  # DDP's "module.": named as the model names it (model_name)
                name = ".".join(p for p in (model_name(prefix, wrapped), leaf) if p)
            entries.append((owner, leaf, name, param))
        keep = all(entry[0] is not None for entry in entries)
        self._cached = (model, version, entries) if keep else None
        return entries


class _GradientAdds:
    """The adds of a step's plain gradients: on the CPU each at once (``add``); on another
    device batched per table, for one ``HistogramTable.add_many`` each (:meth:`flush`:
    on CUDA one Triton launch per dtype, where a launch per gradient cost more host time
    than binning it)."""

    def __init__(self) -> None:
        self._batches: dict[histogram.HistogramTable, tuple[list[int], list[Tensor]]] = {}

    def add(self, place: Place, grad: Tensor) -> None:
        table, row = place
        if grad.is_cpu:
            table.add(row, grad)
            return
        rows, grads = self._batches.setdefault(table, ([], []))
        rows.append(row)
        grads.append(grad)

    def flush(self) -> None:
        for table, (rows, grads) in self._batches.items():
            table.add_many(rows, grads)
        self._batches.clear()


@dataclass(frozen=True)
class MadeNonfinite:
    """The op that first made inf/NaN in a step (forward or backward, as marked): its
    record key and the largest finite magnitude of its outputs in the step."""

    key: RecordKey
    amax: float


@dataclass(frozen=True)
class Collected:
    """A closed step's records, as brought to the host, with the values of the tensors
    given to :meth:`Recorder.collect` (None: no tensor given)."""

    records: StepRecords
    first_nonfinite: str  # "module op" of the first forward op that made inf/NaN, or ""
    loss: float | None
    loss_scale: float | None
    made_nonfinite: MadeNonfinite | None = None  # that op's key and largest finite value


class Recorder:
    """The open step's records: a histogram row per record key the selection accepts,
    on its tensor's device, and (with recipes) each recorded tensor's block statistics."""

    def __init__(self, selection: Selection, blocks: BlockRecorder | None) -> None:
        self.selection = selection
        self.blocks = blocks  # opt-in: --recipe
        self.forward_active = False  # inside Audit.forward_pass: forward outputs too
        self._forward_ops = 0  # forward ops seen this step, in order
        self._accepted: dict[tuple[str, str, str], bool] = {}
        self._tables: dict[torch.device, histogram.HistogramTable] = {}
        self._rows: dict[RecordKey, Place] = {}
        self._row_keys: dict[torch.device, list[RecordKey]] = {}
        self._lock = threading.Lock()
        # what _place found for a key, dtype and device (None: the CPU; found None: not
        # selected)
        self._places: dict[tuple[object, ...], tuple[RecordKey, Place] | None] = {}
        # (parameter name, dtype, device) -> its gradient's row (None: not selected)
        self._grad_rows: dict[tuple[str, torch.dtype, torch.device], Place | None] = {}
        self._walk = _ParameterWalk()  # the model's parameters, kept between steps
        self._plan: _GradPlan | None = None  # of those parameters' gradients
        # per device: (rows, the row keys as columns) for StepRecords.key_columns
        self._key_columns: dict[torch.device, tuple[int, dict[str, np.ndarray]]] = {}

    def record(
        self,
        kind: str,
        module: str,
        node: str,
        op: str,
        output: int,
        scales_with_loss: bool,
        tensor: torch.Tensor,
    ) -> Place | None:
        """Add ``tensor``'s values to the open step's record for this key; its place."""
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()  # a DTensor (FSDP2, tensor parallel): this rank's shard
        device = None if tensor.is_cpu else tensor.device  # CPU: no torch.device built, hashed
        where = (kind, module, node, op, output, scales_with_loss, tensor.dtype, device)
        found: tuple[RecordKey, Place] | None = self._places.get(where, _NEW)  # every output
        if found is _NEW:
            found = self._place(kind, module, node, op, output, scales_with_loss, tensor)
        if found is None:
            return None
        key, place = found
        place[0].add(place[1], tensor)
        if self.blocks is not None:
            self.blocks.add(key, tensor)
        return place

    def _place(
        self,
        kind: str,
        module: str,
        node: str,
        op: str,
        output: int,
        scales_with_loss: bool,
        tensor: torch.Tensor,
    ) -> tuple[RecordKey, Place] | None:
        """The record key of ``tensor`` here and its row (made on first use), or None
        where the selection leaves it out."""
        device = None if tensor.is_cpu else tensor.device  # as ``record`` keys it
        where = (kind, module, node, op, output, scales_with_loss, tensor.dtype, device)
        try:
            return self._places[where]
        except KeyError:  # the first time: once per key
            found = self._places[where] = self._new_place(
                kind, module, node, op, output, scales_with_loss, tensor
            )
            return found

    def _new_place(
        self,
        kind: str,
        module: str,
        node: str,
        op: str,
        output: int,
        scales_with_loss: bool,
        tensor: torch.Tensor,
    ) -> tuple[RecordKey, Place] | None:
        accepted = self._accepted.get((kind, module, op))
        if accepted is None:
            accepted = self._accepted[(kind, module, op)] = self.selection.accepts(kind, module, op)
        if not accepted:
            return None
        dtype = str(tensor.dtype).removeprefix("torch.")
        key = RecordKey(kind, module, node, op, output, dtype, scales_with_loss)
        place = self._rows.get(key)
        if place is None:
            with self._lock:
                table = self._tables.get(tensor.device)
                if table is None:
                    table = self._tables[tensor.device] = histogram.HistogramTable(tensor.device)
                    self._row_keys[tensor.device] = []
                place = self._rows[key] = (table, table.new_row())
                self._row_keys[tensor.device].append(key)
        return key, place

    def record_operand(
        self,
        module: str,
        node: str,
        op: str,
        index: int,
        scales_with_loss: bool,
        tensor: torch.Tensor,
    ) -> None:
        """Add a backward GEMM's operand to the block statistics only (``KIND_OPERAND``:
        no histogram record; its values are an output recorded where it was made)."""
        if self.blocks is None or not tensor.is_floating_point():
            return
        if not self.selection.accepts(KIND_BACKWARD, module, op):
            return
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        dtype = str(tensor.dtype).removeprefix("torch.")
        key = RecordKey(KIND_OPERAND, module, node, op, index, dtype, scales_with_loss)
        self.blocks.add(key, tensor)

    def record_parameter_gradients(self, model: nn.Module) -> None:
        """Record every parameter's gradient (kind ``grad``). The parameters are the
        model's ``named_parameters()``, walked again only when they may have changed
        (:class:`_ParameterWalk`), and kept as a plan (:class:`_GradPlan`): each one's row
        in the CPU table, decided at its first plain gradient, so that closing a step
        adds the plain CPU gradients in one kernel call (``HistogramTable.add_planned``).
        Others (complex, float64, DTensor, other devices, with block statistics, or not
        as planned) are recorded one by one (:meth:`_record_gradient`); off the CPU
        in one ``add_many`` per table (:class:`_GradientAdds`)."""
        entries = self._walk.of(model)
        plan = self._plan
        if plan is None or plan.entries is not entries:
            plan = self._plan = _GradPlan(entries)
        if not plan.owners_hold():
            self._walk.forget()  # replaced behind the hooks' back
            self._plan = None
            self.record_parameter_gradients(model)
            return
        params = plan.params
        table = self._tables.get(_CPU)
        left = None
        if table is not None:  # the kernel reads each parameter's .grad
            left = table.add_planned(params, plan.rows, plan.dtypes, of_params=True)
        adds = _GradientAdds()
        for i in range(len(params)) if left is None else left:
            self._record_gradient(model, plan, i, params[i].grad, adds)
        adds.flush()

    def _record_gradient(
        self, model: nn.Module, plan: _GradPlan, i: int, grad: Tensor | None, adds: _GradientAdds
    ) -> None:
        """Record parameter ``i``'s gradient (a plain one through ``adds``), and where it is
        a plain CPU gradient, plan its row for the next steps (``SKIP``: not selected)."""
        name = plan.entries[i][2]
        if grad is None or grad.layout != torch.strided:
            return
        if type(grad) is torch.Tensor and self.blocks is None and grad.is_floating_point():
            where = (name, grad.dtype, grad.device)
            if where in self._grad_rows:
                place = self._grad_rows[where]
            else:
                module, _, param_name = name.rpartition(".")
                found = self._place(
                    KIND_GRAD, model_name(module), "AccumulateGrad", param_name, 0, True, grad
                )
                place = self._grad_rows[where] = None if found is None else found[1]
            if grad.is_cpu and grad.dtype != torch.float64:
                plan.rows[i] = histogram.SKIP if place is None else place[1]
                plan.dtypes[i] = grad.dtype
            if place is not None:
                adds.add(place, grad)
            return
        if grad.is_complex():
            grad = torch.view_as_real(grad.resolve_conj())
        elif not grad.is_floating_point():
            return
        module, _, param_name = name.rpartition(".")
        self.record(KIND_GRAD, model_name(module), "AccumulateGrad", param_name, 0, True, grad)

    def next_forward_op(self) -> int:
        self._forward_ops += 1
        return self._forward_ops

    def seen_ops(self, kind: str) -> set[str]:
        """The ops seen so far (recorded or left out by the selection)."""
        return {op for (k, _, op) in self._accepted if k == kind}

    def has_open_records(self) -> bool:
        return any(any(table.calls) for table in self._tables.values())

    def out_of_range(self) -> int:
        """fp64 values beyond fp32's range, binned as zero or inf (see
        ``fpaudit.kernels.histogram``)."""
        return sum(int(t.out_of_range) for t in self._tables.values())

    def collect(
        self,
        loss: torch.Tensor | None,
        scale_tensor: torch.Tensor | None,
        *,
        keep_rows: bool = True,
    ) -> Collected:
        """Close the step: each device's rows, with ``loss`` and ``scale_tensor`` where they
        are on that device, in one transfer. The records may be the CPU table's own rows
        (no copy): read them, then :meth:`release` the rows for the next step.
        ``keep_rows`` False: the caller reads no record's ``counts`` (no ``--window``), so
        where the CPU kernel reads the rows' nonzero bins it clears them in the same pass
        and the records carry no ``counts`` (None)."""
        keys: list[RecordKey] = []
        blocks: list[np.ndarray] = []
        calls: list[np.ndarray] = []
        key_columns: dict[str, np.ndarray] | None = None
        nonzero: NonzeroBins | None = None
        loss_value: float | None = None
        scale_value: float | None = None
        for device, table in self._tables.items():
            carries_loss = loss is not None and loss.device == device
            carries_scale = scale_tensor is not None and scale_tensor.device == device
            scalars = ((loss,) if carries_loss and loss is not None else ()) + (
                (scale_tensor,) if carries_scale and scale_tensor is not None else ()
            )
            rows, values = table.collect(scalars)
            if carries_loss:
                loss_value = values[0]
            if carries_scale:
                scale_value = values[-1]
            row_calls = np.array(table.calls, dtype=np.int64)
            row_keys = self._row_keys[device]
            if 0 not in table.calls:  # every row: the rows as they are, no copy
                keys += row_keys
                blocks.append(rows)
                calls.append(row_calls)
                if len(self._tables) == 1:  # the usual case: one device, every row used
                    nonzero = table.nonzero_bins(clear=not keep_rows)
                    key_columns = self._columns_of(device, row_keys)
            else:
                used = np.flatnonzero(row_calls)
                keys += [row_keys[row] for row in used]
                blocks.append(rows[used])
                calls.append(row_calls[used])
        if loss is not None and loss_value is None:  # no records on the loss's device
            loss_value = float(loss.detach().reshape(()))
        if scale_tensor is not None and scale_value is None:
            scale_value = float(scale_tensor.detach().reshape(()))
        if len(blocks) == 1:
            rows = blocks[0]
        else:
            rows = np.concatenate(blocks) if blocks else np.zeros((0, histogram.WIDTH), np.int64)
        records, made = _step_records(
            keys, rows, np.concatenate(calls) if calls else np.zeros(0, dtype=np.int64),
            nonzero, key_columns, keep_rows,
        )  # fmt: skip
        self._forward_ops = 0
        first_nonfinite = f"{made.key.module or '(root)'} {made.key.op}" if made else ""
        return Collected(records, first_nonfinite, loss_value, scale_value, made)

    def _columns_of(self, device: torch.device, row_keys: list[RecordKey]) -> dict[str, np.ndarray]:
        """``row_keys`` as columns, as ``ReportBuilder`` makes them, made again only when
        rows were added (rows are only ever added)."""
        cached = self._key_columns.get(device)
        if cached is None or cached[0] != len(row_keys):
            columns = {f: np.array([getattr(k, f) for k in row_keys]) for f in RecordKey._fields}
            for column in columns.values():  # shared by every step's records: never written
                column.flags.writeable = False
            cached = self._key_columns[device] = (len(row_keys), columns)
        return cached[1]

    def release(self) -> None:
        """Empty the rows for the next step (after a collected step's records are read)."""
        for table in self._tables.values():
            table.reset_touched()

    def discard(self) -> None:
        """Drop the open step's records (and its block statistics)."""
        for table in self._tables.values():
            table.reset_touched()
        if self.blocks is not None:
            self.blocks.discard_open()


def _step_records(
    keys: list[RecordKey],
    rows: np.ndarray,
    calls: np.ndarray,
    nonzero: NonzeroBins | None,
    key_columns: dict[str, np.ndarray] | None,
    keep_rows: bool,
) -> tuple[StepRecords, MadeNonfinite | None]:
    """A closed step's records from its table ``rows`` (or what the kernel read of them,
    ``nonzero``), and its first op that made inf/NaN (None)."""
    if nonzero is None:
        amax_bits = rows[:, histogram.AMAX_COLUMN]
        shadow = rows[:, histogram.SHADOW_COLUMNS].copy()
        scores = rows[:, histogram.FIRST_NONFINITE_COLUMN]
    else:  # the same columns, read by the kernel with the nonzero bins
        amax_bits = nonzero.edge(histogram.AMAX_COLUMN)
        shadow = nonzero.edge_block(histogram.SHADOW_COLUMNS)
        scores = nonzero.edge(histogram.FIRST_NONFINITE_COLUMN)
    records = StepRecords(
        keys=keys,
        counts=rows[:, : histogram.N_BINS] if keep_rows or nonzero is None else None,
        amax=histogram.amax_from_bits(amax_bits),
        calls=calls,
        shadow=shadow,
        nonzero=nonzero,
        key_columns=key_columns,
    )
    made = None
    if len(scores) and scores.max() > 0:
        row = int(np.argmax(scores))
        made = MadeNonfinite(keys[row], float(records.amax[row]))
    return records, made
