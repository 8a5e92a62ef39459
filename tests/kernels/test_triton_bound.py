"""Bound Triton launches (``_triton_kernel.BoundKernel``) against the JIT's own launch.

No GPU here, so Triton runs against a stand-in CUDA driver (the one
``benchmarks/launch_overhead.py`` times launches on): its real JIT binds and
specialises the arguments and its real compiler (ptxas included) builds the kernels
for sm_90, and the stand-in's launcher records what each launch would hand the GPU
instead of launching. A bound launch must hand it exactly what the JIT's launch hands
it (the same compiled kernel, grid, stream and arguments), and arguments of one class
(the bound launch's key) must be ones the JIT gives one compiled kernel. That the
kernels count right on a GPU is ``benchmarks/gpu_check.py``'s (and the interpreter's,
in ``test_triton_kernel.py``).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch

from fpaudit.numerics import layout

from ..conftest import benchmark_module

triton = pytest.importorskip("triton", reason="Triton is not installed")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter compiles nothing", allow_module_level=True)

from fpaudit.kernels import _triton_kernel as K  # noqa: E402

pytestmark = pytest.mark.skipif(not K.BINDS, reason=f"Triton {triton.__version__} is not bound")


@pytest.fixture(scope="module")
def launch_overhead() -> ModuleType:
    return benchmark_module("launch_overhead")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("triton-cache"))  # compiled once for the module


LAUNCHES: list[tuple[Any, ...]] = []  # what the stand-in's launcher was handed


@pytest.fixture
def stand_in(
    monkeypatch: pytest.MonkeyPatch, cache_dir: str, launch_overhead: ModuleType
) -> Iterator[ModuleType]:
    """``_triton_kernel`` on the stand-in driver, its launches recorded in ``LAUNCHES``,
    with fresh bound kernels and JIT caches."""
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences 3.9's notice; no fma here
    LAUNCHES.clear()
    with launch_overhead.stand_in(K, LAUNCHES) as module:
        yield module


def _table(rows: int = 4) -> torch.Tensor:
    return torch.zeros((rows, layout.WIDTH), dtype=torch.int64)


def _cases() -> list[tuple[torch.Tensor, int]]:
    """Tensors of each dtype, aligned and not, of sizes that are 1, a multiple of 16 and
    neither, and rows whose pointers are aligned and not (a row is WIDTH int64s)."""
    assert layout.WIDTH % 2 == 1  # so that rows alternate between 16-byte aligned and not
    cases = []
    for dtype in K.NATIVE:
        base = torch.arange(1, 4200, dtype=torch.float32).to(dtype)
        for start, n in ((0, 1), (0, 32), (0, 1000), (8, 1000), (1, 32), (1, 1000), (0, 4100)):
            cases += [(base[start : start + n], row) for row in (1, 2)]
    return cases


def _same_launch(bound: tuple[Any, ...], jit: tuple[Any, ...]) -> bool:
    """Grid, stream, kernel handle, its metadata and arguments equal (the launch
    metadata and hooks, 6 to 8, are made afresh by each)."""
    if bound[:6] != jit[:6] or len(bound) != len(jit):
        return False
    for a, b in zip(bound[9:], jit[9:], strict=True):
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()):
                return False
        elif a != b or type(a) is not type(b):
            return False
    return True


def test_a_bound_launch_hands_the_launcher_what_the_jits_launch_does(
    stand_in: ModuleType, launch_overhead: ModuleType
) -> None:
    table = _table()
    for x, row in _cases():
        launch_overhead.jit_launch(stand_in, x, table, row)
        jit = LAUNCHES[-1]
        bound_before = stand_in.ONE.bound
        stand_in.add_flat(x, table, row)  # the first of a class: the JIT's, then bound
        stand_in.add_flat(x, table, row)
        assert stand_in.ONE.bound - bound_before in (1, 2), (x.dtype, x.numel(), row)
        assert _same_launch(LAUNCHES[-2], jit), (x.dtype, x.numel(), row)
        assert _same_launch(LAUNCHES[-1], jit), (x.dtype, x.numel(), row)
    # every launch bound but the first of each class
    assert stand_in.ONE.launches == 2 * len(_cases())
    assert stand_in.ONE.bound == stand_in.ONE.launches - len(stand_in.ONE.compiled)


def test_arguments_of_one_class_get_one_compiled_kernel_from_the_jit(
    stand_in: ModuleType, launch_overhead: ModuleType
) -> None:
    # The key is not coarser than the JIT's specialisation: within a class, the JIT
    # returns one compiled kernel for every member (finer would only bind twice), the
    # one bound for that class.
    table = _table()
    kernels: dict[Any, set[int]] = collections.defaultdict(set)
    for x, row in _cases():
        stand_in.add_flat(x, table, row)
        jit = launch_overhead.jit_launch(stand_in, x, table, row)
        key = stand_in.one_key(x, table[row], x.numel())
        assert stand_in.ONE.compiled[key] is jit, (x.dtype, x.numel(), row)
        kernels[key].add(id(jit))
    assert all(len(ids) == 1 for ids in kernels.values())
    assert len(kernels) == len(stand_in.ONE.compiled) >= 2 * len(K.NATIVE)


def test_the_multi_tensor_launch_is_bound_too(stand_in: ModuleType) -> None:
    table = _table()
    # a program counts a segment of one tensor (at most SEGMENT values): one more value
    # than a segment is two programs
    tensors = [
        torch.ones(stand_in.SEGMENT + 1),
        torch.full((3,), 2.0),
        torch.zeros(0),
        torch.ones(16),
    ]
    assert stand_in.histogram_add_many(tensors, table, [0, 1, 2, 3]) == 1
    first = LAUNCHES[-1]
    assert stand_in.histogram_add_many(tensors, table, [0, 1, 2, 3]) == 1
    assert (stand_in.MANY.launches, stand_in.MANY.bound) == (2, 1)
    second = LAUNCHES[-1]
    assert first[:6] == second[:6] and first[:3] == (4, 1, 1)  # 2 + 1 + 0 + 1 segments
    assert [type(a) for a in second[9:]] == [torch.Tensor, torch.Tensor, int, int]


def test_a_launcher_that_refuses_turns_binding_off_and_the_jit_launches(
    stand_in: ModuleType,
) -> None:
    # A compiled kernel whose launcher takes its arguments otherwise than the JIT passes
    # them (a Triton whose launch path is not the one read): the JIT's launch still works.
    table, x = _table(), torch.ones(100)
    stand_in.add_flat(x, table, 1)
    ((key, _),) = stand_in.ONE.compiled.items()

    class Otherwise:
        def __getitem__(self, grid: Any) -> Any:
            def runner(*args: Any) -> None:
                raise TypeError("function takes exactly 14 arguments (16 given)")

            return runner

    stand_in.ONE.compiled[key] = Otherwise()
    stand_in.add_flat(x, table, 1)
    assert not stand_in.ONE.binds and not stand_in.ONE.compiled
    assert stand_in.ONE.bound == 0 and len(LAUNCHES) == 2
    assert _same_launch(LAUNCHES[1], LAUNCHES[0])  # the JIT's, again
    stand_in.add_flat(x, table, 1)
    assert stand_in.ONE.bound == 0 and len(LAUNCHES) == 3
    assert not stand_in.ONE.compiled  # not bound again


def test_the_benchmark_runs_on_the_stand_in(
    launch_overhead: ModuleType, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    saved = K.ONE
    with launch_overhead.stand_in(K) as module:
        result = launch_overhead.measure(module, torch.device("cpu"), rounds=2, calls=3)
        # add_flat twice as a warm-up and 3 a round, bound and not; bound: all but the first
        assert (module.ONE.launches, module.ONE.bound) == (2 * (2 + 2 * 3), 1 + 2 * 3)
        inner = module.ONE
    assert set(result) == {"JIT launch", "add_flat, bound", "add_flat, binding off"}
    assert all(us > 0 for us in result.values())
    assert K.ONE is saved is not inner  # put back


def test_huge_sizes_are_left_to_the_jit() -> None:
    assert K._int_class(1) == (True, False) and K._int_class(4096) == (False, True)
    assert K._int_class(1 << 31) is None  # int64 to the JIT: not bound
    assert K._version("3.6.0") == (3, 6) and K._version("3.10.1+git12ab") == (3, 10)
    assert K._version("3.5.1") < (3, 6) <= K._version("3.9.0")
