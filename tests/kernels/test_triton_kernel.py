"""The GPU histogram kernel (Triton), run in Triton's interpreter on the CPU.

``TRITON_INTERPRET=1`` executes the kernel's Triton program with numpy, op by op, so
these tests check its logic (bins, windows, the values beyond a window, amax, dtypes)
against the pure-torch reference exactly. They cannot check the kernels on a GPU or
their speed: ``benchmarks/gpu_check.py`` does that on a CUDA machine. One test (outside
the interpreter) compiles the histogram kernels ahead of time with Triton's GPU compiler,
which needs no GPU.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so in a normal test run
this module runs itself in a fresh process with the variable set
(``test_in_the_interpreter``); ``TRITON_INTERPRET=1 pytest tests/kernels/test_triton_kernel.py``
runs the tests directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpaudit.errors import UsageError
from fpaudit.kernels import build as kernels
from fpaudit.kernels import histogram as H

from ..conftest import compiled_cpu_kernel, kernel_required, missing_kernel
from ..oracle import edge_values

try:
    import triton
except ImportError as error:  # the dev extras install it on Linux x86_64
    missing_kernel(
        "the Triton kernels", f"Triton does not import ({error}; pip install 'fpaudit[test]')"
    )
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="run by test_in_the_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_in_the_interpreter() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.fixture(scope="module")
def interpreted() -> ModuleType:
    """fpaudit.kernels._triton_kernel, built for the interpreter (TRITON_INTERPRET=1)."""
    from fpaudit.kernels import _triton_kernel

    return _triton_kernel


def _reference(x: torch.Tensor) -> tuple[np.ndarray, int]:
    counts = torch.bincount(H.bin_indices(x), minlength=H.N_BINS).numpy()
    return counts, int(H.finite_amax_bits(H._abs_bits(x)))


def _triton(module: ModuleType, *tensors: torch.Tensor) -> tuple[np.ndarray, int]:
    table = torch.zeros((3, H.WIDTH), dtype=torch.int64)
    for x in tensors:
        module.histogram_add(H.dense_flat(x), table, 1)
    assert not table[0].any() and not table[2].any()  # only its own row
    return table[1, : H.N_BINS].numpy(), int(table[1, H.AMAX_COLUMN])


def _same(x: torch.Tensor, module: ModuleType) -> None:
    counts, amax = _triton(module, x)
    expected, expected_amax = _reference(x)
    assert np.array_equal(counts, expected)
    assert amax == expected_amax


@in_the_interpreter
def test_edge_values(interpreted: ModuleType) -> None:
    # ties at every format's edges, signed zeros, fp32 subnormals, inf, NaN
    _same(edge_values(), interpreted)


@in_the_interpreter
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=3000))
def test_arbitrary_bit_patterns(interpreted: ModuleType, patterns: list[int]) -> None:
    # Random patterns span every binade: most blocks overflow the window.
    _same(
        torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32), interpreted
    )


@in_the_interpreter
def test_many_blocks_windows_and_the_values_beyond_them(interpreted: ModuleType) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3 * interpreted.BLOCK + 17, generator=generator) * 1e-3
    x[::5] = 0.0
    x[7] = 2.0**-149  # 2**-149 .. 2**100 in one block: beyond any window of 63 binades
    x[8] = 2.0**100
    x[interpreted.BLOCK + 3] = float("inf")
    x[-1] = float("nan")
    _same(x, interpreted)


@in_the_interpreter
def test_a_block_without_finite_nonzero_values(interpreted: ModuleType) -> None:
    _same(torch.tensor([0.0, -0.0, float("inf"), float("nan")] * 100), interpreted)


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_through_programs_that_loop(
    interpreted: ModuleType, dtype: torch.dtype
) -> None:
    # 65,536 values: 16 blocks over INTERPRETED_PROGRAMS (4) programs, each counting 4
    # blocks privately from a window fixed by its first block (both signs of every
    # magnitude: most values lie beyond any window of 63 binades).
    x = torch.arange(-(1 << 15), 1 << 15).to(torch.int16).view(dtype)
    assert -(-x.numel() // interpreted.BLOCK) > interpreted.INTERPRETED_PROGRAMS
    _same(x, interpreted)
    _same(x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))], interpreted)


@in_the_interpreter
def test_a_program_whose_first_block_fixes_a_window_later_blocks_leave(
    interpreted: ModuleType,
) -> None:
    block, programs = interpreted.BLOCK, interpreted.INTERPRETED_PROGRAMS
    x = torch.zeros(3 * programs * block + 5)
    x[:block] = 1.0  # program 0's first block: one bin (and its window, 8 binades below)
    x[programs * block :] = torch.randn(x.numel() - programs * block) * 2.0**-60  # below it
    x[2 * programs * block + 9] = 2.0**120  # far above it
    x[-1] = -(2.0**-149)
    # program 1's first block holds only zeros: its window starts at the default base
    _same(x, interpreted)
    _same(x.to(torch.bfloat16), interpreted)


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_read_in_its_own_dtype_and_widened_exactly(
    interpreted: ModuleType, dtype: torch.dtype
) -> None:
    x = torch.cat([edge_values().to(dtype), (torch.randn(5000) * 1e-5).to(dtype)])
    _same(x, interpreted)


@in_the_interpreter
def test_rows_accumulate_and_amax_only_rises(interpreted: ModuleType) -> None:
    a, b = torch.tensor([3.0, 0.5, 0.0]), torch.tensor([1.0, float("inf")])
    counts, amax = _triton(interpreted, a, b)
    expected = _reference(a)[0] + _reference(b)[0]
    assert np.array_equal(counts, expected)
    assert amax == int(torch.tensor(3.0).view(torch.int32))


@in_the_interpreter
def test_other_dtypes_and_layouts_through_the_table(interpreted: ModuleType) -> None:
    x = torch.randn(32, 48) * 1e-6
    for tensor in (x, x.t(), x[:, ::3], x.half(), x.bfloat16(), x.double()):
        table = H.HistogramTable(torch.device("cpu"))
        row = table.new_row()
        assert table._add_compiled(interpreted, row, tensor)
        rows, _ = table.collect()
        expected = torch.bincount(H.bin_indices(tensor.float()), minlength=H.N_BINS).numpy()
        assert np.array_equal(rows[row, : H.N_BINS], expected)


# ---- the multi-tensor histogram kernel (histogram_add_many, HistogramTable.add_many) ----


def _batch(dtype: torch.dtype) -> list[torch.Tensor]:
    """Edge values (ties at 2**-25, signed zeros, fp32 subnormals, inf, NaN), empty
    tensors, strided views (transposed, with gaps, a storage offset), a tensor of several
    blocks with a partial last one, and one-value tensors, in ``dtype``."""
    generator = torch.Generator().manual_seed(5)
    edges = edge_values()
    grid = (torch.randn(40, 96, generator=generator) * 2.0**-130).to(dtype)
    several = torch.randn(2 * 4096 + 5, generator=generator) * 1e-4
    several[: edges.numel()] = edges  # in its first block and its partial last one
    several[-edges.numel() :] = edges
    return [
        edges.to(dtype),
        torch.empty(0, dtype=dtype),
        grid.t(),  # transposed: read in place, in memory order
        grid[::3, 1::2],  # gaps: copied by dense_flat
        edges.to(dtype).flip(0)[7:50],  # a storage offset
        several.to(dtype),
        torch.tensor([2.0**-25], dtype=dtype),
        torch.tensor([-0.0], dtype=dtype),
        torch.empty(0, 4, dtype=dtype),
    ]


def _reference_rows(table_rows: int, rows: list[int], tensors: list[torch.Tensor]) -> np.ndarray:
    """The counts and amax bits of each row by the pure-torch reference (``bin_indices``)."""
    expected = np.zeros((table_rows, H.WIDTH), dtype=np.int64)
    for row, x in zip(rows, tensors, strict=True):
        if x.numel() == 0:
            continue
        counts, amax = _reference(x)
        expected[row, : H.N_BINS] += counts
        expected[row, H.AMAX_COLUMN] = max(expected[row, H.AMAX_COLUMN], amax)
    return expected


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_many_tensors_in_one_launch_equal_one_launch_each_and_the_reference(
    interpreted: ModuleType, dtype: torch.dtype
) -> None:
    tensors = _batch(dtype)
    rows = [1, 3, 2, 2, 4, 3, 0, 4, 1]  # several tensors into the same row, out of order
    flat = [H.dense_flat(x) for x in tensors]
    many = torch.zeros((6, H.WIDTH), dtype=torch.int64)
    assert interpreted.histogram_add_many(flat, many, rows) == 1
    one = torch.zeros_like(many)
    for row, x in zip(rows, flat, strict=True):
        interpreted.histogram_add(x, one, row)
    assert torch.equal(many, one)
    assert np.array_equal(many.numpy(), _reference_rows(6, rows, tensors))
    assert not many[5].any()  # no row but their own


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tensors_whose_programs_loop_past_their_first_blocks_window(
    interpreted: ModuleType, dtype: torch.dtype
) -> None:
    # A tensor of two segments (each one program: up to SEGMENT_BLOCKS blocks, one flush),
    # the second partial; values far above and below the window its first block fixes,
    # NaN and -0.0 at the seam of the two segments, edge values in the second.
    block, segment = interpreted.BLOCK, interpreted.SEGMENT
    generator = torch.Generator().manual_seed(9)
    edges = edge_values()
    long = torch.randn(segment + 2 * block + 3, generator=generator) * 1e-3
    long[block + 1] = 2.0**100
    long[3 * block] = -(2.0**-120)
    long[segment - 1] = float("nan")
    long[segment] = -0.0
    long[segment + 5 : segment + 5 + edges.numel()] = edges
    short = torch.randn(3 * block + 1, generator=generator) * 2.0**-60  # one looping segment
    tensors = [long.to(dtype), edges.to(dtype), short.to(dtype)]
    rows = [0, 1, 0]
    table = torch.zeros((3, H.WIDTH), dtype=torch.int64)
    assert interpreted.histogram_add_many(tensors, table, rows) == 1
    assert np.array_equal(table.numpy(), _reference_rows(3, rows, tensors))


@in_the_interpreter
def test_a_batch_beyond_the_bound_is_split_into_bounded_launches(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = [H.dense_flat(x) for x in _batch(torch.float32)]  # 1 + 0 + 1 + 1 + 1 + 1 + ...
    segments = sum(-(-x.numel() // interpreted.SEGMENT) for x in tensors)
    monkeypatch.setattr(interpreted, "MAX_PROGRAMS", 3)
    rows = list(range(len(tensors)))
    table = torch.zeros((len(tensors), H.WIDTH), dtype=torch.int64)
    assert interpreted.histogram_add_many(tensors, table, rows) == -(-segments // 3)
    assert np.array_equal(table.numpy(), _reference_rows(len(tensors), rows, tensors))


@in_the_interpreter
def test_the_multi_tensor_kernel_refuses_what_it_cannot_read(interpreted: ModuleType) -> None:
    table = torch.zeros((2, H.WIDTH), dtype=torch.int64)
    assert interpreted.histogram_add_many([], table, []) == 0
    assert interpreted.histogram_add_many([torch.empty(0)], table, [1]) == 0
    refused = [
        ([torch.ones(3), torch.ones(2).half()], [0, 1], "one dtype"),
        ([torch.ones(3, 4).t()], [0], "not contiguous"),
        ([torch.ones(3)], [2], "out of range"),
        ([torch.ones(3)], [0, 1], "1 tensors but 2 rows"),
    ]
    for tensors, rows, message in refused:
        with pytest.raises(ValueError, match=message):
            interpreted.histogram_add_many(tensors, table, rows)
    with pytest.raises(TypeError, match="takes"):
        interpreted.histogram_add_many([torch.ones(3, dtype=torch.float64)], table, [0])
    assert not table.any()  # a refused batch adds nothing


@in_the_interpreter
def test_add_many_on_cuda_launches_once_per_dtype_and_adds_as_add_does(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CPU table standing in for a CUDA one: add_many takes its device path (the
    # interpreted kernel reads CPU memory); what is left to add takes the CPU's paths,
    # whose counts are the same
    many_before, one_before = interpreted.MANY.launches, interpreted.ONE.launches
    monkeypatch.setattr(kernels, "device_kernel", lambda: interpreted)
    monkeypatch.setenv(kernels.ENV, "torch")  # the CPU kernel off: no CPU batch path
    table = H.HistogramTable(torch.device("cpu"))
    table_rows = [table.new_row() for _ in range(7)]
    table.device = torch.device("cuda")
    mixed = [*_batch(torch.float32), *_batch(torch.float16), *_batch(torch.bfloat16)]
    mixed += [edge_values().to(torch.float8_e4m3fn), edge_values().to(torch.float8_e5m2)]
    mixed += [edge_values().double(), torch.tensor([1e-300, 1e300, 3.0], dtype=torch.float64)]
    rows = [table_rows[i % 7] for i in range(len(mixed))]
    table.add_many(rows, mixed)
    # fp32 (with the fp8 tensors, widened), fp16, bf16; the fp64 ones: add's pure-torch path
    assert (interpreted.MANY.launches - many_before, interpreted.ONE.launches - one_before) == (
        3,
        0,
    )
    assert interpreted.MANY.bound == interpreted.ONE.bound == 0  # the interpreter binds nothing

    one = H.HistogramTable(torch.device("cpu"))
    for _ in table_rows:
        one.new_row()
    for row, x in zip(rows, mixed, strict=True):
        one.add(row, x)
    assert np.array_equal(table.collect()[0], one.collect()[0])
    assert table.calls == one.calls == [rows.count(row) for row in table_rows]
    assert int(table.out_of_range) == int(one.out_of_range) == 2  # 1e-300 -> 0, 1e300 -> inf
    wide = [x.float() for x in mixed]  # fp64 rounds to fp32 (see histogram's limitations)
    assert np.array_equal(table.collect()[0], _reference_rows(7, rows, wide))


def test_a_failing_multi_tensor_launch_falls_back_to_torch_once_and_adds_each_tensor_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    added: list[torch.dtype] = []

    def bf16_fails(tensors: list[torch.Tensor], table: torch.Tensor, rows: list[int]) -> int:
        if tensors[0].dtype == torch.bfloat16:  # as an old GPU's compiler might
            raise RuntimeError("bf16 not supported\nmore")
        for row, x in zip(rows, tensors, strict=True):  # the reference's counts
            table[row, : H.N_BINS] += torch.bincount(H.bin_indices(x), minlength=H.N_BINS)
            table[row, H.AMAX_COLUMN] = max(
                int(table[row, H.AMAX_COLUMN]), int(H.finite_amax_bits(H._abs_bits(x)))
            )
        added.append(tensors[0].dtype)
        return 1

    fake = SimpleNamespace(NATIVE=(torch.float32, torch.float16, torch.bfloat16),
                           histogram_add_many=bf16_fails)  # fmt: skip
    monkeypatch.setattr(kernels._HISTOGRAM, "module", fake)
    monkeypatch.setattr(kernels._HISTOGRAM, "failure", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    table = H.HistogramTable(torch.device("cpu"))
    rows = [table.new_row() for _ in range(3)]
    x = edge_values()
    tensors = [x, x.bfloat16(), x.half(), x.reshape(-1, 2).t()]
    with pytest.warns(UserWarning, match="Triton histogram kernel failed .*bf16 not supported"):
        H._add_many_compiled(table, fake, [*rows, rows[0]], tensors)  # type: ignore[arg-type]
    assert added == [torch.float32]  # the fp16 batch after the failed one: the torch path
    assert kernels.device_kernel() is None  # not tried again
    assert table.calls == [2, 1, 1]
    expected = _reference_rows(table.rows, [*rows, rows[0]], tensors)
    assert np.array_equal(table.collect()[0], expected)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("arch", [80, 90])
def test_the_gpu_compiler_takes_both_histogram_kernels(
    arch: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Compiled ahead of time (Triton's own compiler and ptxas, no GPU needed) for Ampere
    # and Hopper, each dtype the launches specialise on: the interpreter runs neither the
    # int64-to-pointer casts, the constexpr globals nor the shared helper through it.
    # Exactness on a GPU is benchmarks/gpu_check.py's.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fpaudit.kernels import _triton_kernel as K

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences 3.9's notice; no fma here
    target = GPUTarget("cuda", arch, 32)
    many = {"segments_ptr": "*i64", "table_ptr": "*i64", "BLOCK": "constexpr", "DTYPE": "constexpr"}
    one = {"row_ptr": "*i64", "n": "i32", "BLOCK": "constexpr", "BF16": "constexpr"}
    sources = [
        ASTSource(K._histogram_many_kernel, many, {"BLOCK": K.BLOCK, "DTYPE": kind})
        for kind in range(len(K.NATIVE))
    ]
    sources += [
        ASTSource(K._histogram_kernel, {"x_ptr": x, **one}, {"BLOCK": K.BLOCK, "BF16": bf16})
        for x, bf16 in (("*fp32", False), ("*fp16", False), ("*bf16", True))
    ]
    for source in sources:
        compiled = triton.compile(source, target=target)
        assert compiled.asm["cubin"], source.fn.__name__


def test_a_failing_kernel_falls_back_to_torch_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(x: torch.Tensor, table: torch.Tensor, row: int) -> None:
        raise RuntimeError("PTX too old\nmore")

    fake = SimpleNamespace(NATIVE=(torch.float32,), add_flat=broken)
    monkeypatch.setattr(kernels._HISTOGRAM, "module", fake)
    monkeypatch.setattr(kernels._HISTOGRAM, "failure", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    table = H.HistogramTable(torch.device("cpu"))
    row = table.new_row()
    with pytest.warns(UserWarning, match="Triton histogram kernel failed .*PTX too old"):
        assert not table._add_compiled(fake, row, torch.ones(3))  # type: ignore[arg-type]
    assert kernels.device_kernel() is None  # not tried again
    assert kernels.device_failure() == "RuntimeError: PTX too old"

    monkeypatch.setenv(kernels.ENV, "triton")
    with pytest.raises(UsageError, match="FPAUDIT_KERNEL=triton but"):
        kernels.device_kernel()


def test_torch_mode_never_loads_the_gpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.device_kernel() is None


# ---- the block-statistics kernel (fpaudit/kernels/_triton_blocks.py) ----

BLOCK_BASES = ("mxfp4", "mxfp4-rceil", "mxfp8-e4m3", "mxfp8-e4m3-rceil", "mxfp8-e5m2",
               "mxfp8-e5m2-rceil", "fp8-block-1x128", "fp8-block-128x128")  # fmt: skip
BLOCK_RECIPES = [name for base in BLOCK_BASES for name in (base, base + ":col")]


def _block_vectors(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel's vector (through blockstats' dispatch) and the torch reference's."""
    from fpaudit.kernels import blockstats as B
    from fpaudit.numerics.recipes import get_recipe

    if kernels.mode() == "torch":
        missing_kernel("the Triton block kernel", "FPAUDIT_KERNEL=torch turns it off")
    recipe = get_recipe(name)
    blocks, padding = B._blocks(tensor, recipe)
    got = B._device_stats(blocks, recipe, padding)
    assert got is not None, kernels.device_block_failure()
    return got, B.block_stats(tensor, recipe, general=True)


def _same_blocks(tensor: torch.Tensor, name: str) -> None:
    from fpaudit.kernels import blockstats as B
    from fpaudit.numerics.recipes import get_recipe

    got, expected = _block_vectors(tensor, name)
    assert torch.equal(got, expected), (name, (got - expected).nonzero().flatten().tolist())
    # and hence the C++ kernel's, where it builds (the CPU path of block_stats); where the
    # kernels are required (CI, `make test`) it must build
    if kernel_required():
        compiled_cpu_kernel()
    if kernels.cpu_kernel() is not None:
        assert torch.equal(got, B.block_stats(tensor, get_recipe(name)))


def _maxima_at_every_binade(width: int, mantissas: tuple[float, ...]) -> torch.Tensor:
    """One row of ``width`` values per binade -149..127 and mantissa: the maximum
    ``mantissa * 2**b``, the rest spread 30 binades below it (subnormals and zeros near
    the bottom), with a tie at half the maximum."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for binade in range(-149, 128):
        for mantissa in mantissas:
            top = torch.tensor(mantissa * 2.0**binade, dtype=torch.float64)
            spread = torch.exp2(-30 * torch.rand(width, generator=generator, dtype=torch.float64))
            row = (top * spread).to(torch.float32)
            row[0] = top.to(torch.float32)
            row[1] = (top / 2).to(torch.float32)
            row[2] = -row[2]
            rows.append(row)
    return torch.stack(rows)


@in_the_interpreter
@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_kernel_on_edge_values_and_partial_blocks(name: str) -> None:
    # ties, fp32 subnormals, +-0, inf, NaN; 48 columns: a partial block of 16 per row
    # under 1x32, and partial 1x128 / 128x128 blocks
    edges = edge_values()
    x = torch.cat([edges, edges.flip(0)[: -edges.numel() % 48 or None]])
    x = torch.cat([x, torch.zeros(-x.numel() % 48)]).reshape(-1, 48)
    _same_blocks(x, name)
    finite = torch.where(torch.isfinite(x), x, 1.0)  # no NaN block: every class counted
    _same_blocks(finite, name)


@in_the_interpreter
@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_kernel_with_block_maxima_at_every_binade(name: str) -> None:
    # 2**b, 1.75 * 2**b and the largest fp32 below 2**(b + 1); one per binade per 128
    if "128" in name:
        _same_blocks(_maxima_at_every_binade(128, (2 - 2.0**-23,)), name)
    else:
        _same_blocks(_maxima_at_every_binade(32, (1.0, 1.75, 2 - 2.0**-23)), name)


@in_the_interpreter
@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=1500),
    st.sampled_from(BLOCK_RECIPES),
    st.sampled_from([32, 48, 128, 200]),
)
def test_block_kernel_on_arbitrary_bit_patterns(patterns: list[int], name: str, width: int) -> None:
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.zeros(-x.numel() % width)]).reshape(-1, width)
    _same_blocks(x, name)


@in_the_interpreter
@pytest.mark.parametrize("name", ["mxfp4", "mxfp8-e4m3-rceil", "fp8-block-1x128:col"])
def test_block_kernel_on_low_precision_and_strided_inputs(name: str) -> None:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=generator) * torch.exp2(
        torch.randint(-20, 10, (64, 1), generator=generator).float()
    )
    x[3, 5] = 0.0
    for tensor in (x.half(), x.bfloat16(), x.t(), x[:, ::3], x.double(), x[0, 0]):
        _same_blocks(tensor, name)


def test_uncovered_recipes_and_the_torch_mode_keep_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fpaudit.kernels import _triton_blocks
    from fpaudit.kernels import blockstats as B
    from fpaudit.numerics.recipes import RECIPES, get_recipe

    covered = {name for name, recipe in RECIPES.items() if _triton_blocks.covers(recipe)}
    assert covered == {name.removesuffix(":col") for name in BLOCK_RECIPES}
    blocks, padding = B._blocks(torch.ones(4, 16), get_recipe("nvfp4"))
    assert B._device_stats(blocks, get_recipe("nvfp4"), padding) is None
    monkeypatch.setenv(kernels.ENV, "torch")
    assert kernels.device_block_kernel() is None


def test_a_failing_block_kernel_falls_back_to_torch_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fpaudit.kernels import blockstats as B
    from fpaudit.numerics.recipes import get_recipe

    def broken(*args: object) -> None:
        raise RuntimeError("out of resources\nmore")

    fake = SimpleNamespace(covers=lambda recipe: True, block_stats_add=broken)
    monkeypatch.setattr(kernels._BLOCKS, "module", fake)
    monkeypatch.setattr(kernels._BLOCKS, "failure", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    recipe = get_recipe("mxfp8-e4m3")
    blocks, padding = B._blocks(torch.ones(2, 32), recipe)
    with pytest.warns(UserWarning, match="Triton block-statistics kernel failed .*out of res"):
        assert B._device_stats(blocks, recipe, padding) is None
    assert kernels.device_block_kernel() is None  # not tried again
    assert kernels.device_block_failure() == "RuntimeError: out of resources"

    monkeypatch.setenv(kernels.ENV, "triton")
    with pytest.raises(UsageError, match="FPAUDIT_KERNEL=triton but the GPU block"):
        kernels.device_block_kernel()
