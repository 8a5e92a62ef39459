"""The multi-tensor histogram (``HistogramTable.add_many``: one kernel call for a step's
parameter gradients) against the one-tensor path and the pure-torch reference; and
closing a step from the bins a table's adds touched: the CPU kernel's small-tensor path
(at most 2,048 values, binned straight into the row), the spans it keeps per row, the
nonzero bins it finds from them and the rows it clears, against the reference and
numpy's reading of the whole rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from fpaudit.capture.recorder import Recorder
from fpaudit.capture.selection import Selection
from fpaudit.kernels import histogram as H
from fpaudit.report.records import EDGE_COLUMNS, KIND_GRAD, ReportBuilder

from ..conftest import compiled_cpu_kernel
from ..oracle import edge_values


def _reference(x: torch.Tensor) -> tuple[np.ndarray, float]:
    """Counts by the pure-torch reference (``bin_indices``) and the finite amax, by torch."""
    values = x.detach().float().reshape(-1)
    counts = torch.bincount(H.bin_indices(values), minlength=H.N_BINS).numpy()
    finite = values[torch.isfinite(values)]
    return counts, float(finite.abs().max()) if finite.numel() else 0.0


def _tensors() -> list[torch.Tensor]:
    """Edge values (ties, signed zeros, fp32 subnormals, inf, NaN) in every dtype the batch
    takes, empty tensors, strided views (transposed, sliced with gaps, broadcast), fp64."""
    torch.manual_seed(0)
    edges = edge_values()
    wide = torch.randn(64, 48) * 2.0**-130  # fp32 subnormals and small normals
    grid = torch.cat([edges, torch.randn(4 * 96 - edges.numel())]).reshape(4, 96)
    return [
        edges,
        edges.to(torch.float16),
        edges.to(torch.bfloat16),
        edges.to(torch.float8_e4m3fn),
        edges.to(torch.float8_e5m2),
        torch.empty(0),
        torch.empty(0, 3, dtype=torch.float16),
        wide,
        wide.t(),  # transposed: read in place, in memory order
        wide[::2, 1::3],  # gaps: copied
        grid.t().to(torch.bfloat16),
        torch.tensor([-0.0, 0.0, float("inf")]).expand(5, 3),  # broadcast: copied
        edges.double(),  # fp64: the one-tensor path, with its out-of-range count
        torch.tensor([1e-300, 1e300, 3.0], dtype=torch.float64),
        edges.flip(0)[5:40],  # a view with a storage offset
    ]


def test_many_tensors_in_one_call_equal_one_call_each_and_the_reference() -> None:
    compiled_cpu_kernel()
    tensors = _tensors()
    many = H.HistogramTable(torch.device("cpu"), capacity=2)  # also grows
    one = H.HistogramTable(torch.device("cpu"), capacity=2)
    rows = [many.new_row() for _ in tensors]
    for _ in tensors:
        one.new_row()
    # some rows twice, out of order: additions accumulate
    order = [*range(len(tensors)), 3, 0, 11]
    many.add_many([rows[i] for i in order], [tensors[i] for i in order])
    for i in order:
        one.add(i, tensors[i])
    many_rows, _ = many.collect()
    one_rows, _ = one.collect()
    assert np.array_equal(many_rows, one_rows)
    assert many.calls == one.calls == [order.count(i) for i in range(len(tensors))]
    assert int(many.out_of_range) == int(one.out_of_range) == 2  # 1e-300 -> 0, 1e300 -> inf
    for i, x in enumerate(tensors):
        counts, amax = _reference(x)
        times = order.count(i)
        host = H.HostHistogram.from_row(many_rows[i], many.calls[i])
        assert np.array_equal(host.counts, counts * times), i
        assert host.amax == amax, i


def test_the_pure_torch_path_takes_the_same_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors()
    compiled = H.HistogramTable(torch.device("cpu"))
    rows = [compiled.new_row() for _ in tensors]
    compiled.add_many(rows, tensors)
    monkeypatch.setenv("FPAUDIT_KERNEL", "torch")
    fallback = H.HistogramTable(torch.device("cpu"))
    for _ in tensors:
        fallback.new_row()
    fallback.add_many(rows, tensors)
    assert np.array_equal(compiled.collect()[0], fallback.collect()[0])
    assert compiled.calls == fallback.calls == [1] * len(tensors)


def test_an_empty_batch_and_a_tensor_the_kernel_refuses() -> None:
    kernel = compiled_cpu_kernel()
    table = H.HistogramTable(torch.device("cpu"))
    table.add_many([], [])
    assert table.rows == 0
    row = table.new_row()
    with pytest.raises(RuntimeError, match="strided floating CPU tensors"):
        kernel.histogram_add_many([torch.arange(3)], table.table, [row], list(H.CLASS_LOWER_BOUNDS))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.histogram_add_many(
            [torch.ones(3)], table.table, [table.table.shape[0]], list(H.CLASS_LOWER_BOUNDS)
        )
    assert not table.table.any()  # a refused batch adds nothing


def test_the_per_op_call_equals_the_fp32_call_on_its_flattened_values() -> None:
    # histogram_add_tensor widens and flattens in C++ what the Python path widened with
    # .to(float32) and flattened with dense_flat before histogram_add
    kernel = compiled_cpu_kernel()
    tensors = [x for x in _tensors() if x.dtype != torch.float64]
    table = H.HistogramTable(torch.device("cpu"))
    direct, flattened = table.new_row(), table.new_row()
    for x in tensors:
        table.add(direct, x)  # histogram_add_tensor
        kernel.histogram_add(
            H.dense_flat(x.to(torch.float32)), table.table, flattened, list(H.CLASS_LOWER_BOUNDS)
        )
        rows, _ = table.collect()
        assert np.array_equal(rows[direct], rows[flattened])
        counts, amax = _reference(x)
        host = H.HostHistogram.from_row(rows[direct], 1)
        assert np.array_equal(host.counts, counts) and host.amax == amax
        table.reset()


def _sized(n: int, seed: int) -> torch.Tensor:
    """``n`` values: the edge values (ties at 2**-25, signed zeros, fp32 subnormals, inf,
    NaN) repeated and shuffled, so each size holds them all or as many as fit."""
    generator = torch.Generator().manual_seed(seed)
    edges = edge_values()
    tiled = edges.repeat(n // edges.numel() + 1)[:n]
    return tiled[torch.randperm(n, generator=generator)]


def _sized_tensors() -> list[torch.Tensor]:
    """Both sides of the small path's bound (2,048 values), mixed dtypes, empty tensors,
    strided views (transposed, with gaps, broadcast)."""
    grid = _sized(64 * 48, 1).reshape(64, 48)
    return [
        _sized(1, 0),
        _sized(2047, 2),
        _sized(2048, 3),
        _sized(2049, 4),
        _sized(5000, 5),
        _sized(2048, 6).to(torch.float16),
        _sized(2049, 7).to(torch.bfloat16),
        _sized(300, 8).to(torch.float8_e4m3fn),
        torch.empty(0),
        grid.t(),
        grid[::2, 1::3],
        torch.tensor([-0.0, 2.0**-149, float("nan")]).expand(700, 3),
    ]


def test_each_size_bins_as_the_reference_on_both_sides_of_the_small_path() -> None:
    compiled_cpu_kernel()
    tensors = _sized_tensors()
    table = H.HistogramTable(torch.device("cpu"))
    for x in tensors:
        table.add(table.new_row(), x)
    rows, _ = table.collect()
    for i, x in enumerate(tensors):
        counts, amax = _reference(x)
        host = H.HostHistogram.from_row(rows[i], 1)
        assert np.array_equal(host.counts, counts), i
        assert host.amax == amax, i


def _filled() -> H.HistogramTable:
    tensors = _sized_tensors()
    table = H.HistogramTable(torch.device("cpu"), capacity=2)  # grows: spans grow with it
    rows = [table.new_row() for _ in tensors]
    table.new_row()  # a row no add touches
    table.add_many(rows, tensors)
    for row, x in zip(rows[::3], tensors[::3], strict=True):
        table.add(row, x * 2.0**-20)  # a second add into some rows, elsewhere in the range
    return table


def test_a_table_grown_by_the_kernel_keeps_its_rows_and_spans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows made after the first add (the kernel resolved) grow the table as the kernel's
    mapped memory: first to ``_MAPPED_ROWS`` rows, then doubling. Every row added before
    a growth reads the same after it, spans included, as in a table that never grew."""
    compiled_cpu_kernel()
    monkeypatch.setattr(H, "_MAPPED_ROWS", 6)
    tensors = _sized_tensors() + [x.float() * 2.0**-30 for x in _sized_tensors()]
    grown = H.HistogramTable(torch.device("cpu"), capacity=2)
    reference = H.HistogramTable(torch.device("cpu"), capacity=64)
    sizes = []
    for x in tensors:
        for table in (grown, reference):
            table.add(table.new_row(), x)  # the first add resolves the kernel
        sizes.append(grown.table.shape[0])
    # 2 rows, then 6 (the first growth after the first add), then doubling: 12, 24
    expected = [2 if n <= 2 else 6 if n <= 6 else 12 if n <= 12 else 24 for n in range(1, 30)]
    assert len(tensors) > 12 and sizes == expected[: len(tensors)]
    assert grown.spans is not None and reference.spans is not None
    rows = grown.rows
    assert np.array_equal(grown.collect()[0], reference.collect()[0][:rows])
    assert torch.equal(grown.spans[:rows], reference.spans[:rows])
    assert (grown.spans[rows:] == torch.tensor([H.N_BINS, -1])).all()


def test_the_kernels_nonzero_bins_are_numpys_reading_of_the_whole_rows() -> None:
    compiled_cpu_kernel()
    table = _filled()
    table.add_shadow(0, torch.tensor([0.0, 1.0, 2.0**-30]), torch.ones(3))  # shadow columns
    table.mark_nonfinite(1, torch.tensor([float("inf")]), 5)  # the first non-finite column
    found = table.nonzero_bins()
    assert found is not None
    rows, _ = table.collect()
    finite = rows[:, H.FIRST_FINITE_BIN : H.INF_BIN]
    expected_rows, expected_offsets = np.divmod(np.flatnonzero(finite != 0), finite.shape[1])
    assert np.array_equal(found.row, expected_rows)
    assert np.array_equal(found.offset, expected_offsets)
    assert np.array_equal(found.count, finite[expected_rows, expected_offsets])
    # each row's finite sum, and its columns outside the finite bins, as the rows hold them
    assert np.array_equal(found.finite, finite.sum(axis=1))
    assert np.array_equal(found.edges, rows[:, list(EDGE_COLUMNS)])
    assert found.edge(H.NAN_BIN).tolist() == rows[:, H.NAN_BIN].tolist()
    assert np.array_equal(found.edge_block(H.SHADOW_COLUMNS), rows[:, H.SHADOW_COLUMNS])
    assert found.edges[:, 0].any() and found.edge_block(H.SHADOW_COLUMNS).any()
    assert found.edge(H.FIRST_NONFINITE_COLUMN)[1] > 0
    assert table.spans is not None
    spans = table.spans[: table.rows].numpy()
    for row in range(table.rows):  # every nonzero bin but zero's lies in the row's span
        bins = np.flatnonzero(rows[row, 1 : H.N_BINS]) + 1
        assert not len(bins) or (spans[row, 0] <= bins.min() and bins.max() <= spans[row, 1])
    assert spans[-1].tolist() == [H.N_BINS, -1]  # untouched


def test_reading_with_clear_reads_the_same_and_leaves_the_rows_as_new() -> None:
    compiled_cpu_kernel()
    kept, cleared = _filled(), _filled()
    for table in (kept, cleared):
        table.add_shadow(0, torch.tensor([0.0, 1.0]), torch.ones(2))
        table.mark_nonfinite(1, torch.tensor([float("inf")]), 5)
    read, read_clearing = kept.nonzero_bins(), cleared.nonzero_bins(clear=True)
    assert read is not None and read_clearing is not None
    for name in ("row", "offset", "count", "finite", "edges"):
        assert np.array_equal(getattr(read, name), getattr(read_clearing, name)), name
    assert kept.table.any()
    assert not cleared.table.any()  # every bin and column, as reset_touched leaves them
    assert cleared.spans is not None
    assert (cleared.spans[: cleared.rows] == torch.tensor([H.N_BINS, -1])).all()
    cleared.reset_touched()  # still what closes the step (the calls): nothing left to clear
    assert not cleared.table.any() and cleared.calls == [0] * cleared.rows


def test_a_row_written_after_the_clearing_read_is_cleared_by_reset_touched() -> None:
    """reset_touched skips its pass after nonzero_bins(clear=True) only while nothing
    wrote a row since: an add (it counts a call), the shadow columns and the first
    non-finite op (they count none) each make it clear again."""
    compiled_cpu_kernel()
    writes = {
        "add": lambda t: t.add(2, torch.tensor([3.0, -0.5])),
        "add_many": lambda t: t.add_many([1], [torch.tensor([7.0])]),
        "shadow": lambda t: t.add_shadow(0, torch.tensor([0.0, 1.0]), torch.ones(2)),
        "nonfinite": lambda t: t.mark_nonfinite(1, torch.tensor([float("inf")]), 5),
        "new row, then add": lambda t: t.add(t.new_row(), torch.tensor([1.0])),
    }
    for name, write in writes.items():
        table = _filled()
        assert table.nonzero_bins(clear=True) is not None
        write(table)
        assert table.table.any(), name  # the write is there to be cleared
        table.reset_touched()
        assert not table.table.any(), name
        assert table.calls == [0] * table.rows, name
    untouched = _filled()
    untouched.nonzero_bins(clear=True)
    untouched.new_row()  # a new row is clean: nothing to clear
    untouched.reset_touched()
    assert not untouched.table.any() and untouched.calls == [0] * untouched.rows


def test_clearing_the_touched_bins_leaves_the_rows_as_new() -> None:
    compiled_cpu_kernel()
    table = _filled()
    table.add_shadow(0, torch.zeros(3), torch.ones(3))  # columns after the bins, too
    table.mark_nonfinite(1, torch.tensor([float("inf")]), 5)
    table.reset_touched()
    assert not table.table.any()
    assert table.calls == [0] * table.rows
    assert table.spans is not None
    assert (table.spans[: table.rows, 0] == H.N_BINS).all()
    assert (table.spans[: table.rows, 1] == -1).all()
    again, fresh = _filled(), _filled()  # filled again after the clear, as a new table
    again.reset_touched()
    for row, x in enumerate(_sized_tensors()):
        again.add(row, x)
        fresh_row = fresh.new_row()
        fresh.add(fresh_row, x)
    expected = H.HistogramTable(torch.device("cpu"))
    for x in _sized_tensors():
        expected.add(expected.new_row(), x)
    assert np.array_equal(again.collect()[0][: expected.rows], expected.collect()[0])


def test_the_builder_emits_the_same_rows_from_the_recorders_bins_and_columns() -> None:
    compiled_cpu_kernel()
    recorder = Recorder(Selection(), None)
    for i, x in enumerate(_sized_tensors()):
        recorder.record("backward", f"layer.{i % 3}", "MmBackward0", "aten.mm.default", i % 2,
                        True, x)  # fmt: skip
    records = recorder.collect(None, None).records
    assert records.nonzero is not None and records.key_columns is not None
    by_kernel, by_numpy = ReportBuilder(["layer.0"]), ReportBuilder(["layer.0"])
    by_kernel.add_step(records, loss=None, loss_scale=1.0, seconds=0.0)
    plain = dataclasses.replace(records, nonzero=None, key_columns=None)
    by_numpy.add_step(plain, loss=None, loss_scale=1.0, seconds=0.0)
    kernel_tables, numpy_tables = by_kernel.columns(), by_numpy.columns()
    for kernel_table, numpy_table in zip(kernel_tables[:2], numpy_tables[:2], strict=True):
        assert kernel_table.keys() == numpy_table.keys()
        for name, column in kernel_table.items():
            assert np.array_equal(column, numpy_table[name]), name
    recorder.release()


def _grad_counts(recorder: Recorder, param: str) -> np.ndarray:
    records = recorder.collect(None, None).records
    rows = [i for i, k in enumerate(records.keys) if k.kind == KIND_GRAD and k.op == param]
    counts = records.counts[rows].sum(axis=0)
    recorder.release()
    return counts


def test_the_cached_parameter_list_follows_replaced_parameters() -> None:
    compiled_cpu_kernel()
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    recorder = Recorder(Selection(), None)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    recorder.record_parameter_gradients(model)
    # both weights' rows: 2 x 3 + 2 x 2 = 10 values 0.5
    assert np.array_equal(_grad_counts(recorder, "weight"), _reference(torch.full((10,), 0.5))[0])
    # through setattr (a registration hook), and straight into the owner's parameters
    model[0].weight = nn.Parameter(torch.zeros(2, 3))
    model[0].weight.grad = torch.full((2, 3), 3.0)
    replaced = nn.Parameter(torch.zeros(2, 2))
    replaced.grad = torch.full((2, 2), 2.0**-140)  # a subnormal
    dict.__setitem__(vars(model[1])["_parameters"], "weight", replaced)
    recorder.record_parameter_gradients(model)
    # 6 values 3.0 and 4 values 2**-140: each row as the reference bins them
    expected = _reference(torch.full((6,), 3.0))[0] + _reference(torch.full((4,), 2.0**-140))[0]
    assert np.array_equal(_grad_counts(recorder, "weight"), expected)
    # a swap no hook sees, alone: found by the check of each cached parameter
    swapped = nn.Parameter(torch.zeros(2))
    swapped.grad = torch.tensor([-0.0, float("inf")])
    dict.__setitem__(vars(model[1])["_parameters"], "bias", swapped)
    recorder.record_parameter_gradients(model)
    # model[0].bias's 2 values 0.5, and the swapped bias's -0.0 and inf
    expected = _reference(torch.tensor([0.5, 0.5, -0.0, float("inf")]))[0]
    assert np.array_equal(_grad_counts(recorder, "bias"), expected)


def test_planned_gradients_in_one_call_equal_one_call_each_and_the_reference() -> None:
    # HistogramTable.add_planned, closing a step: each gradient the plan expects (its row,
    # its dtype) is added as add() adds it; None, SKIP and the unexpected are not added,
    # the unexpected (unplanned, another dtype, float64, complex, another device) left
    compiled_cpu_kernel()
    tensors = [x for x in _tensors() if x.dtype != torch.float64]
    planned = H.HistogramTable(torch.device("cpu"), capacity=2)  # also grows
    one = H.HistogramTable(torch.device("cpu"), capacity=2)
    rows = [planned.new_row() for _ in tensors]
    for _ in tensors:
        one.new_row()
    grads: list[torch.Tensor | None] = [*tensors, None, tensors[0], tensors[1], tensors[0]]
    plan_rows = [*rows, rows[0], H.SKIP, rows[1], H.UNPLANNED]
    dtypes = [x.dtype for x in tensors] + [torch.float32] * 4  # tensors[1] is fp16: left
    others = [torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.complex64),
              torch.ones(3, device="meta")]  # fmt: skip
    grads += others
    plan_rows += [rows[0]] * len(others)
    dtypes += [x.dtype for x in others]
    left = planned.add_planned(grads, plan_rows, dtypes)
    # the fp16 tensor planned as fp32, the unplanned one, and the three others
    first_other = len(tensors) + 4
    assert left == [len(tensors) + 2, len(tensors) + 3, *range(first_other, len(grads))]
    for i, x in enumerate(tensors):
        one.add(i, x)
    planned_rows, _ = planned.collect()
    one_rows, _ = one.collect()
    assert np.array_equal(planned_rows, one_rows)
    assert planned.calls == one.calls == [1] * len(tensors)
    for i, x in enumerate(tensors):
        counts, amax = _reference(x)
        host = H.HostHistogram.from_row(planned_rows[i], 1)
        assert np.array_equal(host.counts, counts), i
        assert host.amax == amax, i


def test_a_plan_of_parameters_reads_their_gradients_as_the_plan_of_gradients() -> None:
    # add_planned(of_params=True): the kernel reads each parameter's .grad; a parameter
    # without a gradient is skipped, one with a dispatch of its own is left to the caller
    from torch.testing._internal.two_tensor import TwoTensor

    compiled_cpu_kernel()
    tensors = [x for x in _tensors() if x.dtype != torch.float64 and x.numel()]
    params = [nn.Parameter(torch.zeros(x.shape, dtype=x.dtype)) for x in tensors]
    for param, x in zip(params, tensors, strict=True):
        param.grad = x
    bare = nn.Parameter(torch.zeros(3))  # no gradient this step
    own = nn.Parameter(TwoTensor(torch.zeros(2), torch.zeros(2)))
    own.grad = TwoTensor(torch.ones(2), torch.ones(2))
    of_params, of_grads = (
        H.HistogramTable(torch.device("cpu")),
        H.HistogramTable(torch.device("cpu")),
    )
    rows = [of_params.new_row() for _ in tensors]
    for _ in tensors:
        of_grads.new_row()
    dtypes = [x.dtype for x in tensors] + [torch.float32] * 2
    left = of_params.add_planned([*params, bare, own], [*rows, rows[0], rows[0]], dtypes,
                                 of_params=True)  # fmt: skip
    assert left == [len(tensors) + 1]  # the parameter with a dispatch of its own
    assert of_grads.add_planned(tensors, rows, dtypes[: len(tensors)]) == []
    assert np.array_equal(of_params.collect()[0], of_grads.collect()[0])
    assert of_params.calls == of_grads.calls == [1] * len(tensors)
    for i, x in enumerate(tensors):
        assert np.array_equal(of_params.collect()[0][i, : H.N_BINS], _reference(x)[0]), i


def test_a_plan_with_a_row_out_of_range_adds_nothing() -> None:
    kernel = compiled_cpu_kernel()
    table = H.HistogramTable(torch.device("cpu"))
    row = table.new_row()
    assert table.add_planned([], [], []) == []
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.histogram_add_planned([torch.ones(3), torch.ones(3)], table.table,
                                     [row, table.table.shape[0]],
                                     [torch.float32, torch.float32], table.spans)  # fmt: skip
    assert not table.table.any()  # a refused plan adds nothing
    assert table.spans is not None and table.spans[row].tolist() == [H.N_BINS, -1]


def test_the_fast_per_op_call_is_the_per_op_call() -> None:
    # histogram_add_fast: histogram_add_tensor without pybind11's argument casters
    kernel = compiled_cpu_kernel()
    tensors = [x for x in _tensors() if x.dtype != torch.float64]
    fast, tensor = H.HistogramTable(torch.device("cpu")), H.HistogramTable(torch.device("cpu"))
    for x in tensors:
        kernel.histogram_add_fast(x, fast.table, fast.new_row(), fast.spans)
        row = tensor.new_row()
        kernel.histogram_add_tensor(x, tensor.table, row, tensor.spans)
    assert np.array_equal(fast.collect()[0], tensor.collect()[0])
    assert fast.spans is not None and tensor.spans is not None
    assert torch.equal(fast.spans, tensor.spans)
    with pytest.raises(RuntimeError, match="histogram_add_many needs strided floating"):
        kernel.histogram_add_fast(torch.ones(3, dtype=torch.float64), fast.table, 0, fast.spans)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.histogram_add_fast(torch.ones(3), fast.table, -1, fast.spans)
    with pytest.raises(TypeError, match="tensors and an int"):
        kernel.histogram_add_fast(torch.ones(3), fast.table, 0)


def _mixed_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    model[1].to(torch.bfloat16)
    model[2].to(torch.float64)
    return model


def test_a_planned_step_records_what_a_fresh_recorder_records() -> None:
    # the plan (rows and dtypes decided at a gradient's first sight) against a recorder
    # that decides everything anew each step, over steps whose gradients change: dtype,
    # None, edge values (ties, signed zeros, subnormals, inf, NaN), strided, fp64, complex
    compiled_cpu_kernel()
    model = _mixed_model()
    model.register_parameter("phase", nn.Parameter(torch.zeros(3, dtype=torch.complex64)))
    edges = edge_values()
    planned = Recorder(Selection(), None)
    steps = [
        lambda p: torch.full_like(p, 0.5),
        lambda p: edges[: p.numel()].reshape(p.shape).to(p.dtype),
        lambda p: None if p.dim() == 1 else torch.full_like(p.t(), 2.0**-140).t(),
        lambda p: edges[-p.numel() :].reshape(p.shape).to(p.dtype),
    ]
    for step, make in enumerate(steps):
        if step == 3:
            model[0].to(torch.float16)  # the same parameters, their dtype changed
        for p in model.parameters():
            p.grad = make(p)
        planned.record_parameter_gradients(model)
        fresh = Recorder(Selection(), None)
        fresh.record_parameter_gradients(model)
        got = _by_key(planned)
        assert got == _by_key(fresh)
        expected = {}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            values = torch.view_as_real(p.grad) if p.grad.is_complex() else p.grad
            expected[(name, str(values.dtype).removeprefix("torch."))] = _reference(values)
        assert {(k[0], k[1]): (k[2], k[3]) for k in got} == {
            k: (tuple(c.tolist()), a) for k, (c, a) in expected.items()
        }
        planned.release()
        fresh.release()


def _by_key(recorder: Recorder) -> set[tuple[str, str, tuple[int, ...], float]]:
    """The open step's gradient records: (parameter, dtype, counts, amax)."""
    records = recorder.collect(None, None).records
    found = set()
    for i, key in enumerate(records.keys):
        if key.kind == KIND_GRAD and records.calls[i]:
            name = f"{key.module}.{key.op}" if key.module else key.op
            found.add((name, key.dtype, tuple(records.counts[i].tolist()), float(records.amax[i])))
    return found


def test_gradients_off_the_cpu_go_to_one_add_many_per_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # on the meta device (the nearest to CUDA here): no add each, one add_many with each
    # gradient's own row, step after step; the float64 gradient inside it too (add_many
    # gives it to add, with its out-of-range count)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].to(torch.float16)
    model[3].to(torch.float64)
    model.to("meta")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    batches: list[tuple[H.HistogramTable, list[int], list[torch.Tensor]]] = []
    adds: list[int] = []  # by the recorder (what add_many hands to add is its own business)
    inside = [False]
    add_many, add = H.HistogramTable.add_many, H.HistogramTable.add

    def spy_many(table: H.HistogramTable, rows: list[int], tensors: list[torch.Tensor]) -> None:
        batches.append((table, list(rows), list(tensors)))
        inside[0] = True
        add_many(table, rows, tensors)
        inside[0] = False

    def spy_add(table: H.HistogramTable, row: int, x: torch.Tensor) -> None:
        if not inside[0]:
            adds.append(row)
        add(table, row, x)

    monkeypatch.setattr(H.HistogramTable, "add_many", spy_many)
    monkeypatch.setattr(H.HistogramTable, "add", spy_add)
    recorder = Recorder(Selection(), None)
    for step in range(2):
        batches.clear()
        recorder.record_parameter_gradients(model)
        assert adds == [] and len(batches) == 1, step
        table, rows, grads = batches[0]
        assert all(g is p.grad for g, p in zip(grads, model.parameters(), strict=True))
        keys = recorder._row_keys[torch.device("meta")]
        assert [(keys[row].module, keys[row].op, keys[row].dtype) for row in rows] == [
            (model_name, name.rpartition(".")[2], str(p.dtype).removeprefix("torch."))
            for (name, p), model_name in zip(
                model.named_parameters(), ["0", "0", "2", "2", "3", "3"], strict=True
            )
        ]
        assert table.calls == [step + 1] * 6
