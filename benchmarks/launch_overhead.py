"""Host time of one Triton histogram launch: the JIT's own launch against the bound one.

    PYTHONPATH=. python benchmarks/launch_overhead.py [--rounds 7] [--calls 500] [--quick]

Every output the capture records on CUDA is one launch of the histogram kernel, made
from Python; on a small tensor the host's work for it is longer than the kernel. Printed,
side by side (interleaved rounds, medians), in µs per launch:

* the JIT's launch, ``kernel[grid](...)``, as every launch was made before launches were
  bound;
* ``add_flat``, the path of a recorded output: bound (``_triton_kernel.BoundKernel``) and,
  for comparison, with binding off (the JIT's launch behind the same key);
* on CUDA, ``HistogramTable.add`` of a recorded output (everything the capture adds per
  output: the table's dispatch, the flattening, the launch).

On a CUDA machine it times the real launches, each round followed by a synchronize
(rounds of ``--calls`` launches stay inside the GPU's launch queue). Without a GPU it
runs Triton against a stand-in CUDA driver (:class:`StandInDriver`): the JIT, its
specialisation and the compiler (for sm_90) are Triton's own, the launcher launches
nothing, so what is timed is the host's Python work per launch, which is what binding
removes; the driver's own launch call is in neither number. Needs Triton (and, without a
GPU, its bundled ptxas). The machine is shared and noisy: compare medians and ratios.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from fpaudit.kernels import histogram
from fpaudit.numerics import layout

STREAM = 7  # the stand-in's current stream


class StandInDriver:
    """The CUDA driver as Triton's JIT and compiled kernels ask it: an H100's target and
    properties, a kernel handle per binary, and a launcher that launches nothing (and
    appends each launch's arguments to ``record``, where one is given)."""

    def __init__(self, record: list[tuple[Any, ...]] | None = None) -> None:
        class Launcher:
            def __init__(self, src: Any, metadata: Any) -> None:
                pass

            def __call__(self, *args: Any) -> None:
                if record is not None:
                    record.append(args)

        self.launcher_cls = Launcher
        self.utils = SimpleNamespace(load_binary=self._load, get_device_properties=self._props)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return STREAM

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def _load(name: str, binary: bytes, shared: int, device: int) -> tuple[int, int, int, int, int]:
        return 1, hash(binary), 32, 0, 1024  # module, function (one per binary), regs, ...

    @staticmethod
    def _props(device: int) -> dict[str, int]:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536}


@contextmanager
def stand_in(module: Any, record: list[tuple[Any, ...]] | None = None) -> Iterator[Any]:
    """Triton on a :class:`StandInDriver` inside the block, with fresh bound kernels and
    JIT caches in ``module`` (``fpaudit.kernels._triton_kernel``), all put back after;
    ``record``: as :class:`StandInDriver`'s."""
    from triton.runtime import driver

    saved = driver._active
    names = ("ONE", "MANY")
    bound = {name: getattr(module, name) for name in names}
    caches = {name: kernel.fn.device_caches for name, kernel in bound.items()}
    driver.set_active(StandInDriver(record))
    for name, kernel in bound.items():
        setattr(module, name, module.BoundKernel(kernel.fn))
        kernel.fn.device_caches = collections.defaultdict(kernel.fn.create_binder)
    try:
        yield module
    finally:
        for name, kernel in bound.items():
            for kernels in kernel.fn.device_caches.values():  # nothing for the real driver
                for compiled in kernels[0].values():  # to unload
                    compiled.module = None
            kernel.fn.device_caches = caches[name]
            setattr(module, name, kernel)
        driver.set_active(saved)


def jit_launch(module: Any, x: torch.Tensor, table: torch.Tensor, row: int) -> Any:
    """The JIT's own launch of ``module``'s one-tensor kernel, as ``add_flat`` made it
    before launches were bound; the compiled kernel the JIT returns (None: interpreted)."""
    n = x.numel()
    return module.ONE.fn[(-(-n // module.BLOCK),)](  # not triton.cdiv: see add_flat
        x, table[row], n, BLOCK=module.BLOCK, BF16=x.dtype == torch.bfloat16
    )


def measure(module: Any, device: torch.device, rounds: int, calls: int) -> dict[str, float]:
    """µs per launch of each variant on a 1,000-value fp32 tensor, medians of ``rounds``
    interleaved rounds of ``calls`` launches."""
    x = torch.randn(1000, device=device)
    table = torch.zeros((4, layout.WIDTH), dtype=torch.int64, device=device)

    def unbound() -> None:
        binds, module.ONE.binds = module.ONE.binds, False
        try:
            module.add_flat(x, table, 1)
        finally:
            module.ONE.binds = binds

    variants: dict[str, Callable[[], None]] = {
        "JIT launch": lambda: jit_launch(module, x, table, 1),
        "add_flat, bound": lambda: module.add_flat(x, table, 1),
        "add_flat, binding off": unbound,
    }
    if device.type == "cuda":
        hist = histogram.HistogramTable(device)
        row = hist.new_row()
        variants["HistogramTable.add"] = lambda: hist.add(row, x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for run in variants.values():  # compiled, bound
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(rounds):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            run = variants[name]
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            sync()
            times[name].append(1e6 * (time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def report(result: dict[str, float], where: str) -> None:
    jit = result["JIT launch"]
    print(f"one Triton histogram launch, 1,000 fp32 values, {where}:")
    for name, us in result.items():
        print(f"  {name:24s} {us:7.2f} us  {us / jit:5.2f}x the JIT launch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="a few launches, for a smoke run")
    args = parser.parse_args(argv)
    rounds, calls = (1, 5) if args.quick else (args.rounds, args.calls)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9's notice; no fma here
    from fpaudit.kernels import _triton_kernel as module

    if not module.BINDS:
        print(f"launch_overhead: Triton {module.triton.__version__} is not bound", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, Triton {module.triton.__version__}")
    if torch.cuda.is_available():
        report(measure(module, torch.device("cuda"), rounds, calls), torch.cuda.get_device_name())
        return 0
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        with stand_in(module):
            result = measure(module, torch.device("cpu"), rounds, calls)
        del os.environ["TRITON_CACHE_DIR"]
    report(result, "no GPU: a stand-in driver, host work only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
