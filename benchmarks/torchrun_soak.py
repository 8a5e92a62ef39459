"""Launch the test suite's torchrun jobs over and over and count gloo teardown aborts.

    PYTHONPATH=. python benchmarks/torchrun_soak.py 100

Each launch runs two ranks on gloo (CPU), cycling through the jobs tests/run/test_distributed.py
launches. A launch *aborts* when a rank dies with "terminate called without an active
exception" (the gloo teardown crash of pytorch/pytorch#179291) or on a signal; any other
unexpected exit code is a *failure*. Prints one line per launch and a summary; exit 0 only
when no launch aborted or failed. This is the evidence behind the suite running its torchrun
tests once, without a retry.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
MLP = ROOT / "sample_configs" / "mlp.py"


def jobs(out: Path) -> list[tuple[str, list[str], int]]:
    """(name, torchrun arguments, expected exit code): the suite's launches."""
    return [
        ("scan", ["-m", "fpaudit", "scan", str(MLP), "--steps", "3", "--out", str(out)], 0),
        ("ddp_audit", [str(SCRIPTS / "ddp_audit.py"), str(out)], 0),
        ("fsdp2", [str(SCRIPTS / "fsdp_audit.py"), str(out)], 0),
        ("fsdp1", [str(SCRIPTS / "fsdp_audit.py"), str(out), "flat"], 0),
        ("lightning", [str(SCRIPTS / "lightning_ddp.py"), str(out)], 0),
        ("huggingface", [str(SCRIPTS / "hf_ddp.py"), str(out)], 0),
        ("second_run", ["-m", "fpaudit", "scan", str(MLP), "--steps", "1", "--out", str(out)], 1),
    ]


def main() -> int:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 70
    aborted = failed = 0
    seconds: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(launches):
            out = Path(tmp) / "report"
            name, args, expected = jobs(out)[i % 7]
            if name != "second_run":
                shutil.rmtree(out, ignore_errors=True)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2", *args]  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
            seconds.append(time.perf_counter() - start)
            crash = "terminate called" in done.stderr or "Signal 6" in done.stderr
            ok = (done.returncode == 0) == (expected == 0)
            verdict = "ABORT" if crash else ("ok" if ok else f"FAIL rc={done.returncode}")
            aborted += crash
            failed += (not ok) and not crash
            print(f"{i + 1:4d} {name:12s} rc={done.returncode:3d} {verdict}", flush=True)
            if verdict != "ok":
                print(done.stderr[-2000:], flush=True)
    seconds.sort()
    print(f"launches {launches}, aborted {aborted}, other failures {failed}, "
          f"median launch {seconds[len(seconds) // 2]:.1f} s")  # fmt: skip
    return 0 if aborted == failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
