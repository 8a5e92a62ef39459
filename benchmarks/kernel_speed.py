"""The CPU histogram kernel's cost per value against one read of the same values.

    PYTHONPATH=. python benchmarks/kernel_speed.py [--quick] [--sizes 4K,1M] [--recipe]
        [--reps N] [--dtypes fp32,bf16] [--json OUT]

For each dtype, size, thread count (1 and every core torch uses), and layout
(contiguous, and a strided view: every other element of a tensor twice as long), it
times ``HistogramTable.add`` (the call the audit makes per recorded tensor: the compiled
kernel where it is built) and ``x.sum()`` (one pass over the same values in their own
dtype; fp8 has no CPU sum, so its read is ``x.view(torch.uint8).sum()``, the same bytes
read once as integers). Each repetition times both at every thread count, one after the
other (the order alternating from one repetition to the next), so that the rows of one
tensor and the ratios between them are measured side by side. It prints medians in ns
per value with the ratio, and the best (smallest) of each beside them: on a shared
machine the best is the time with the fewest interruptions. One-thread rows also give
the calling thread's CPU time per value (``time.thread_time``: the kernel and the sum
run on the calling thread there), which time spent waiting for a core does not inflate,
and the share of the wall time the thread ran (under 90%: the machine was busy). After
the table, the speedup of every core over one: the median over repetitions of each
repetition's own ratio. ``close`` rows time a step close's ``HistogramTable.add_many``
over many tensors (a model's gradients: sizes from 64 to 64 K values, that many values
in all) against a sum of each. ``--recipe`` adds the block-statistics kernel
(``blockstats.block_stats_add``, mxfp8-e4m3) on fp32.

The values are ``randn * 1e-3`` (fp8: ``randn``, which its range holds), seeded: the
printed rows and their order are the same on every run; only the times differ. The
machine's load (``os.getloadavg()`` and the runnable processes other than this one) is
printed before and after, since a shared machine's timings say little without it.
``--quick`` (sizes 4K, 1M and 8M, 15 repetitions) takes about a minute on 2 cores; the default
sizes are 4K, 64K, 1M, 8M and 64M values, 31 repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fpaudit.kernels import build as kernels
from fpaudit.kernels.histogram import HistogramTable

DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TARGET_SECONDS = 0.002  # each timing repeats its call to last about this long (short:
# on a shared machine the best of many short timings is the one least interrupted)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale


def size_name(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def machine_load() -> str:
    """The load averages and the runnable processes other than this one (from /proc)."""
    one, five, fifteen = os.getloadavg()
    running: list[str] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, _, rest = stat.rpartition(")")
        if rest.split()[0] == "R":
            running.append(name.partition("(")[2])
    return (
        f"load average {one:.2f} {five:.2f} {fifteen:.2f}; "
        f"{len(running)} other runnable process(es): {', '.join(sorted(running)) or '-'}"
    )


def values(n: int, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n)
    length = 2 * n if strided else n
    x = torch.randn(length, generator=generator)
    x = (x if dtype in FP8 else x * 1e-3).to(dtype)
    return x[::2] if strided else x


def read_once(x: torch.Tensor) -> Callable[[], object]:
    if x.dtype in FP8:
        raw = x.view(torch.uint8)
        return raw.sum
    return x.sum


def timed(call: Callable[[], object], loops: int) -> tuple[float, float]:
    """Seconds per call: wall time and the calling thread's CPU time."""
    cpu, start = time.thread_time(), time.perf_counter()
    for _ in range(loops):
        call()
    return (time.perf_counter() - start) / loops, (time.thread_time() - cpu) / loops


@dataclass
class Timing:
    """ns per value at one thread count: medians, minima, and (one thread) CPU time."""

    histogram: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    histogram_cpu: list[float] = field(default_factory=list)
    read_cpu: list[float] = field(default_factory=list)

    def summary(self) -> tuple[float, float, float, float]:
        return (
            statistics.median(self.histogram),
            statistics.median(self.read),
            min(self.histogram),
            min(self.read),
        )


def measure(
    histogram: Callable[[], object],
    read: Callable[[], object],
    values: int,
    reps: int,
    thread_counts: list[int],
) -> dict[int, Timing]:
    """``histogram`` and ``read`` at each thread count, every repetition timing all of
    them one after the other (the order alternating), in ns per value."""
    torch.set_num_threads(thread_counts[0])
    histogram()
    read()
    once = max(timed(histogram, 1)[0], timed(read, 1)[0], 1e-7)
    loops = max(1, min(1000, int(TARGET_SECONDS / once)))
    timings = {threads: Timing() for threads in thread_counts}
    scale = 1e9 / values
    for rep in range(reps):
        order = thread_counts if rep % 2 == 0 else thread_counts[::-1]
        for threads in order:
            torch.set_num_threads(threads)
            timing = timings[threads]
            calls = [(timing.histogram, timing.histogram_cpu, histogram)]
            calls.append((timing.read, timing.read_cpu, read))
            for wall_times, cpu_times, call in calls if rep % 2 == 0 else calls[::-1]:
                wall, cpu = timed(call, loops)
                wall_times.append(wall * scale)
                cpu_times.append(cpu * scale)
    return timings


def close_tensors(total: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of 64 to 64 K values (sizes cycling through powers of 4), ``total`` in all."""
    sizes: list[int] = []
    size = 64
    while sum(sizes) + size <= total:
        sizes.append(size)
        size = size * 4 if size < 1 << 16 else 64
    if total > sum(sizes):
        sizes.append(total - sum(sizes))
    generator = torch.Generator().manual_seed(total)
    return [(torch.randn(s, generator=generator) * 1e-3).to(dtype) for s in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 4K, 1M and 8M, 15 repetitions")
    parser.add_argument("--sizes", help="comma-separated sizes, e.g. 4K,1M,64M")
    parser.add_argument("--dtypes", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--reps", type=int, help="repetitions (default 31; quick 15)")
    parser.add_argument("--recipe", action="store_true", help="also the block-statistics kernel")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    sizes = (
        [parse_size(s) for s in args.sizes.split(",")]
        if args.sizes
        else [1 << 12, 1 << 20, 1 << 23]
        if args.quick
        else [1 << 12, 1 << 16, 1 << 20, 1 << 23, 1 << 26]
    )
    names = args.dtypes.split(",") if args.dtypes else list(DTYPES)
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype {unknown[0]!r}; known: {', '.join(DTYPES)}")
    reps = args.reps or (15 if args.quick else 31)
    cores = torch.get_num_threads()
    thread_counts = sorted({1, cores})

    table = HistogramTable(torch.device("cpu"))
    row = table.new_row()
    table.add(row, torch.ones(4))  # resolves (and if need be builds) the kernel
    kernel = "C++ kernel" if kernels.cpu_kernel() is not None else "pure-torch path"
    print(f"# kernel_speed: torch {torch.__version__}, {kernel}, {cores} threads available")
    print(f"# before: {machine_load()}")
    print(
        "| dtype | layout | values | threads | histogram ns/value | read ns/value | ratio "
        "| best: histogram | read | ratio | 1 thread, CPU time: histogram | read | ratio "
        "| ran |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: list[dict[str, object]] = []
    speedups: list[str] = []

    def emit(dtype: str, layout: str, n: int, timings: dict[int, Timing]) -> None:
        for threads, timing in timings.items():
            hist, read, best_hist, best_read = timing.summary()
            record: dict[str, object] = {
                "dtype": dtype,
                "layout": layout,
                "values": n,
                "threads": threads,
                "histogram_ns": hist,
                "read_ns": read,
                "best_histogram_ns": best_hist,
                "best_read_ns": best_read,
            }
            cpu = "| - | - | - | - |"
            if threads == 1:
                hist_cpu = statistics.median(timing.histogram_cpu)
                read_cpu = statistics.median(timing.read_cpu)
                ran = sum(timing.histogram_cpu) / sum(timing.histogram)
                record |= {"histogram_cpu_ns": hist_cpu, "read_cpu_ns": read_cpu, "ran": ran}
                cpu = (
                    f"| {hist_cpu:.3f} | {read_cpu:.3f} | {hist_cpu / read_cpu:.1f}x | {ran:.0%} |"
                )
            rows.append(record)
            print(
                f"| {dtype} | {layout} | {size_name(n)} | {threads} | {hist:.3f} | {read:.3f} "
                f"| {hist / read:.1f}x | {best_hist:.3f} | {best_read:.3f} "
                f"| {best_hist / best_read:.1f}x {cpu}",
                flush=True,
            )
        if len(timings) > 1:
            one, many = timings[1], timings[cores]
            paired = [a / b for a, b in zip(one.histogram, many.histogram, strict=True)]
            best = min(one.histogram) / min(many.histogram)
            speedups.append(
                f"#   {dtype} {layout} {size_name(n)}: {statistics.median(paired):.2f}x; "
                f"{best:.2f}x"
            )

    for name in names:
        dtype = DTYPES[name]
        for n in sizes:
            for layout in ("contiguous", "strided"):
                x = values(n, dtype, layout == "strided")
                timings = measure(partial(table.add, row, x), read_once(x), n, reps, thread_counts)
                emit(name, layout, n, timings)
                del x
        for n in sizes if dtype not in FP8 else []:
            tensors = close_tensors(n, dtype)
            rows_of = [table.new_row() for _ in tensors]

            def close(tensors: list[torch.Tensor] = tensors, rows_of: list[int] = rows_of) -> None:
                table.add_many(rows_of, tensors)

            def read_each(tensors: list[torch.Tensor] = tensors) -> None:
                for t in tensors:
                    t.sum()

            timings = measure(close, read_each, n, reps, thread_counts)
            emit(name, f"close ({len(tensors)} tensors)", n, timings)
            table.reset()
    if args.recipe:
        from fpaudit.kernels import blockstats
        from fpaudit.numerics.recipes import get_recipe

        recipe = get_recipe("mxfp8-e4m3")
        total = torch.from_numpy(blockstats.empty())
        for n in sizes:
            x = values(n, torch.float32, False)
            add = partial(blockstats.block_stats_add, x, recipe, total)
            timings = measure(add, x.sum, n, reps, thread_counts)
            emit("fp32", "blocks (mxfp8-e4m3)", n, timings)
    torch.set_num_threads(cores)
    print(f"# after: {machine_load()}")
    if speedups:
        print(
            f"# the histogram on {cores} threads over 1, faster by (median of each "
            "repetition's ratio; best over best):"
        )
        print("\n".join(speedups))
    if args.json:
        args.json.write_text(json.dumps({"threads": cores, "reps": reps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
