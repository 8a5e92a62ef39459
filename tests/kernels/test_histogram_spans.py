"""Closing a step from the bins a table's adds touched: the CPU kernel's small-tensor path
(at most 2,048 values, binned straight into the row), the spans it keeps per row, the
nonzero bins it finds from them and the rows it clears, against the pure-torch
reference (``bin_indices``) and numpy's reading of the whole rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from fpaudit.capture.recorder import Recorder
from fpaudit.capture.selection import Selection
from fpaudit.kernels import histogram as H
from fpaudit.report.records import KIND_GRAD, ReportBuilder

from ..conftest import compiled_cpu_kernel
from ..oracle import edge_values


def _reference(x: torch.Tensor) -> tuple[np.ndarray, float]:
    """Counts by the pure-torch reference (``bin_indices``) and the finite amax, by torch."""
    values = x.detach().float().reshape(-1)
    counts = torch.bincount(H.bin_indices(values), minlength=H.N_BINS).numpy()
    finite = values[torch.isfinite(values)]
    return counts, float(finite.abs().max()) if finite.numel() else 0.0


def _sized(n: int, seed: int) -> torch.Tensor:
    """``n`` values: the edge values (ties at 2**-25, signed zeros, fp32 subnormals, inf,
    NaN) repeated and shuffled, so each size holds them all or as many as fit."""
    generator = torch.Generator().manual_seed(seed)
    edges = edge_values()
    tiled = edges.repeat(n // edges.numel() + 1)[:n]
    return tiled[torch.randperm(n, generator=generator)]


def _tensors() -> list[torch.Tensor]:
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
    tensors = _tensors()
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
    tensors = _tensors()
    table = H.HistogramTable(torch.device("cpu"), capacity=2)  # grows: spans grow with it
    rows = [table.new_row() for _ in tensors]
    table.new_row()  # a row no add touches
    table.add_many(rows, tensors)
    for row, x in zip(rows[::3], tensors[::3], strict=True):
        table.add(row, x * 2.0**-20)  # a second add into some rows, elsewhere in the range
    return table


def test_the_kernels_nonzero_bins_are_numpys_reading_of_the_whole_rows() -> None:
    compiled_cpu_kernel()
    table = _filled()
    found = table.nonzero_bins()
    assert found is not None
    rows, _ = table.collect()
    finite = rows[:, H.FIRST_FINITE_BIN : H.INF_BIN]
    expected_rows, expected_offsets = np.divmod(np.flatnonzero(finite != 0), finite.shape[1])
    assert np.array_equal(found[0], expected_rows)
    assert np.array_equal(found[1], expected_offsets)
    assert np.array_equal(found[2], finite[expected_rows, expected_offsets])
    assert table.spans is not None
    spans = table.spans[: table.rows].numpy()
    for row in range(table.rows):  # every nonzero bin but zero's lies in the row's span
        bins = np.flatnonzero(rows[row, 1 : H.N_BINS]) + 1
        assert not len(bins) or (spans[row, 0] <= bins.min() and bins.max() <= spans[row, 1])
    assert spans[-1].tolist() == [H.N_BINS, -1]  # untouched


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
    for row, x in enumerate(_tensors()):
        again.add(row, x)
        fresh_row = fresh.new_row()
        fresh.add(fresh_row, x)
    expected = H.HistogramTable(torch.device("cpu"))
    for x in _tensors():
        expected.add(expected.new_row(), x)
    assert np.array_equal(again.collect()[0][: expected.rows], expected.collect()[0])


def test_the_builder_emits_the_same_rows_from_the_recorders_bins_and_columns() -> None:
    compiled_cpu_kernel()
    recorder = Recorder(Selection(), None)
    for i, x in enumerate(_tensors()):
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
