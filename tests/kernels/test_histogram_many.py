"""The multi-tensor histogram (``HistogramTable.add_many``: one kernel call for a step's
parameter gradients) against the one-tensor path and the pure-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fpaudit.kernels import histogram as H

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
