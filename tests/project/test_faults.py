"""Faults a careful user meets outside the bad-input battery: real signals at known
moments, forked children, a stale kernel build lock, full, read-only and size-limited
disks, model code that exits. Every test runs fpaudit as a real subprocess (or, where
the CLI's in-process path is the same, through ``cli.run``) and checks that no report
is lost, faked, or half-written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fpaudit.report.store import Report

from ..conftest import MODELS, ROOT, SAMPLES, one_error_line

FAULTS = MODELS / "faults.py"


@pytest.fixture(autouse=True)
def _pure_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs: no kernel notes on stderr (the kernel tests set their own)."""
    monkeypatch.setenv("FPAUDIT_KERNEL", "torch")


def _default_signals() -> None:
    """In the child: SIGINT and SIGTERM as a terminal would deliver them, even when the
    test runs as a background job (which ignores SIGINT), and nothing blocked."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _spawn(args: list[object], *, cwd: Path = ROOT, **env: str) -> subprocess.Popen[str]:
    environment = {**os.environ, "FPAUDIT_KERNEL": "torch", **env}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "fpaudit", *map(str, args)],
        env=environment, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_signals,
    )  # fmt: skip


def _fpaudit(args: list[object], *, cwd: Path = ROOT, **env: str) -> tuple[int, str, str]:
    process = _spawn(args, cwd=cwd, **env)
    out, err = process.communicate(timeout=600)
    return process.returncode, out, err


def _reach(process: subprocess.Popen[str], marker: Path) -> None:
    """Wait until the model file wrote ``marker``: the process sits at the fault."""
    deadline = time.monotonic() + 300
    while not marker.exists():
        if process.poll() is not None:
            raise AssertionError(process.communicate())
        assert time.monotonic() < deadline, "the process never reached the fault"
        time.sleep(0.05)
    time.sleep(0.2)  # the marker is written just before the sleep loop starts


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("fpaudit: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def _good_report(out: Path, steps: int = 3) -> Report:
    code, _, err = _fpaudit(["scan", FAULTS, "--steps", steps, "--out", out])
    assert code == 0, err
    return Report.read(out)


def _same(a: Report, b: Report) -> bool:
    return a.meta == b.meta and a.records.equals(b.records) and a.steps.equals(b.steps)


# -- 2. signals never cost a report ----------------------------------------------------
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_while_the_finished_scan_writes_do_not_cost_the_report(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    # Before: Ctrl-C here ended with exit 130, empty stderr and no report.
    marker, out = tmp_path / "marker", tmp_path / "r"
    written = marker.with_suffix(".write")
    process = _spawn(["scan", FAULTS, "--steps", 3, "--out", out],
                     FAULT_AT="write", FAULT_MARKER=str(marker))  # fmt: skip
    _reach(process, written)
    process.send_signal(sig)
    time.sleep(0.3)
    process.send_signal(sig)  # a second one, as an impatient user sends
    written.unlink()  # let the write go on
    _, err = process.communicate(timeout=300)
    assert process.returncode == code, err
    assert f"interrupted by {sig.name} while writing the report; it was written whole" in err
    report = Report.read(out)
    assert report.complete and report.meta["steps_run"] == 3
    assert not (tmp_path / "r.lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # no staging left


def test_a_second_ctrl_c_inside_the_write_itself(tmp_path: Path) -> None:
    """The first Ctrl-C stops the scan in step 2; the write hook then holds the write of
    the 2 completed steps while the test sends SIGINT twice more."""
    marker, out = tmp_path / "marker", tmp_path / "r"
    process = _spawn(["scan", FAULTS, "--steps", 10, "--out", out],
                     FAULT_AT="step:2,write", FAULT_MARKER=str(marker))  # fmt: skip
    written = marker.with_suffix(".write")
    _reach(process, marker)  # in step 2 (the loss hook)
    process.send_signal(signal.SIGINT)  # stops the scan: the write of 2 steps begins
    _reach(process, written)  # inside the write
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    written.unlink()
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "interrupted by SIGINT after 2 of 10 step(s); the completed steps are in" in err
    report = Report.read(out)
    assert report.meta["steps_run"] == 2 and not report.complete


def test_ctrl_c_in_step_0_of_scan_force_keeps_the_good_report(tmp_path: Path) -> None:
    out, marker = tmp_path / "r", tmp_path / "marker"
    good = _good_report(out)
    process = _spawn(["scan", FAULTS, "--steps", 5, "--out", out, "--force"],
                     FAULT_AT="step:0", FAULT_MARKER=str(marker))  # fmt: skip
    _reach(process, marker)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    line = _error_line(err)
    assert "after 0 of 5 step(s); kept the existing report" in line
    assert "(3 completed step(s))" in line and "--replace-partial" in line
    assert _same(Report.read(out), good)
    # Asked for explicitly, the partial report replaces it.
    marker.unlink(missing_ok=True)
    process = _spawn(["scan", FAULTS, "--steps", 5, "--out", out, "--force", "--replace-partial"],
                     FAULT_AT="step:1", FAULT_MARKER=str(marker))  # fmt: skip
    _reach(process, marker)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    replaced = Report.read(out)
    assert replaced.meta["steps_run"] == 1 and not replaced.complete


@pytest.mark.parametrize("where", ["import", "model"])
def test_sigterm_outside_the_step_loop_exits_143(tmp_path: Path, where: str) -> None:
    # Before: 130 (click turned the exception into a plain Abort).
    marker = tmp_path / "marker"
    process = _spawn(["scan", FAULTS, "--steps", 2, "--out", tmp_path / "r"],
                     FAULT_AT=where, FAULT_MARKER=str(marker))  # fmt: skip
    _reach(process, marker)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 143, err
    assert _error_line(err) == "fpaudit: error: interrupted by SIGTERM"
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.lock").exists()


def test_a_reader_racing_force_replacements_sees_old_or_new_never_corrupt(
    tmp_path: Path,
) -> None:
    import torch

    from ..reports import report_from

    out = tmp_path / "r"
    small = report_from({"a": torch.tensor([1.0, 2.0**-20])}, steps=1)
    large = report_from({"a": torch.randn(5000), "b": torch.randn(3000)}, steps=8)
    small.write(out)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(out)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        preexec_fn=_default_signals,  # its Ctrl-C must land under a shell that ignores it
    )  # fmt: skip
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        writes = 0
        while reader.poll() is None and time.monotonic() < deadline:
            (large if writes % 2 else small).write(out, force=True)
            writes += 1
    finally:
        reader.send_signal(signal.SIGINT)
        out_text, _ = reader.communicate(timeout=60)
    result = json.loads(out_text.strip().splitlines()[-1])
    assert writes >= 10 and result["reads"] >= 10, (writes, result)
    assert result["errors"] == [], result["errors"][:3]
    assert set(result["steps"]) <= {1, 8}


READER = """
import json, sys
from fpaudit.report import store as report
from fpaudit.errors import ReportError
from fpaudit.report.store import Report
if len(sys.argv) > 2:  # the check before this fix: no second read
    report._READ_ATTEMPTS = 1
reads, errors, steps = 0, [], set()
print("ready", flush=True)
try:
    while True:
        try:
            steps.add(len(Report.read(sys.argv[1]).steps))
        except ReportError as error:
            errors.append(str(error))
        reads += 1
except KeyboardInterrupt:
    pass
print(json.dumps({"reads": reads, "errors": errors, "steps": sorted(steps)}))
"""


def test_a_crash_between_the_two_renames_is_recovered_on_the_next_write(
    tmp_path: Path, cli
) -> None:
    """Where renameat2 is unavailable the old report is moved aside first; a process
    killed (SIGKILL) right after that move loses nothing: the next write puts it back."""
    out = tmp_path / "r"
    good = _good_report(out)
    crash = (
        "import os, signal, sys\n"
        "from fpaudit.report import store as report\n"
        "from tests.reports import report_from\n"
        "import torch\n"
        "real = os.rename\n"
        "def rename(a, b):\n"
        "    real(a, b)\n"
        "    if str(b).endswith('.old'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "report.os.rename = rename\n"
        "report_from({'a': torch.ones(3)}).write(sys.argv[1], force=True)\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", crash, str(out)], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FPAUDIT_NO_RENAME_EXCHANGE": "1"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists() and (tmp_path / ".r.old" / "meta.json").exists()
    # The next run that writes there restores it first: without --force it refuses.
    line = one_error_line(cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out))
    assert "already exists; pass --force" in line
    assert _same(Report.read(out), good) and not (tmp_path / ".r.old").exists()


def test_force_without_rename_exchange_replaces_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from ..reports import report_from

    monkeypatch.setenv("FPAUDIT_NO_RENAME_EXCHANGE", "1")
    out = tmp_path / "r"
    report_from({"a": torch.ones(3)}, steps=1).write(out)
    report_from({"a": torch.ones(3)}, steps=4).write(out, force=True)
    assert len(Report.read(out).steps) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# -- 3. only the process that started the audit writes it ------------------------------
FORKING_SCRIPT = """
import fcntl, json, os, sys
import torch
out, result = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
child = None
for step in range(4):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    if step == 1:
        child = os.fork()
        if child == 0:  # the child trains two steps of its own, then ends its script
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
            sys.exit(0)
        _, status = os.waitpid(child, 0)
        # The child ended: the parent's lock must still be held.
        fd = os.open(out + ".lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        os.close(fd)
        with open(result, "w") as handle:
            json.dump({"child_status": os.waitstatus_to_exitcode(status), "lock_held": held,
                       "report_exists": os.path.exists(out)}, handle)
"""


def test_run_on_a_script_that_forks_keeps_the_parents_report(tmp_path: Path) -> None:
    # Before: the child wrote a 2-step report marked complete and deleted the parent's
    # lock; the parent's 4 steps were lost.
    script, out, result = tmp_path / "train.py", tmp_path / "r", tmp_path / "result.json"
    script.write_text(FORKING_SCRIPT)
    code, _, err = _fpaudit(["run", "--out", out, "--capture-every", 1, "--", script, out,
                             result])  # fmt: skip
    assert code == 0, err
    seen = json.loads(result.read_text())
    assert seen == {"child_status": 0, "lock_held": True, "report_exists": False}
    report = Report.read(out)
    assert report.complete and report.meta["steps_run"] == 4
    assert list(report.steps["step"]) == [0, 1, 2, 3]
    assert not (tmp_path / "r.lock").exists()


def test_scan_of_a_model_file_that_forks_keeps_the_parents_report(tmp_path: Path) -> None:
    """The child forked in loss() runs the rest of the scan loop, as fork makes it; it
    must neither write nor unlock. The parent waits for it, then checks the lock."""
    model, out, result = tmp_path / "model.py", tmp_path / "r", tmp_path / "result.json"
    model.write_text(
        "import fcntl, json, os, sys, torch\n"
        f"OUT, RESULT = {str(out)!r}, {str(result)!r}\n"
        "model = torch.nn.Linear(4, 1)\n"
        "batches = [torch.randn(8, 4) for _ in range(5)]\n"
        "calls = {'n': 0}\n"
        "def loss(model, batch):\n"
        "    calls['n'] += 1\n"
        "    if calls['n'] == 2:\n"
        "        child = os.fork()\n"
        "        if child:\n"
        "            _, status = os.waitpid(child, 0)\n"
        "            fd = os.open(OUT + '.lock', os.O_RDWR)\n"
        "            try:\n"
        "                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "                held = False\n"
        "            except BlockingIOError:\n"
        "                held = True\n"
        "            with open(RESULT, 'w') as handle:\n"
        "                json.dump({'child': os.waitstatus_to_exitcode(status), 'held': held,\n"
        "                           'exists': os.path.exists(OUT)}, handle)\n"
        "    return model(batch).pow(2).mean()\n"
    )
    code, _, err = _fpaudit(["scan", model, "--steps", 5, "--out", out])
    assert code == 0, err
    assert json.loads(result.read_text()) == {"child": 0, "held": True, "exists": False}
    report = Report.read(out)
    assert report.complete and list(report.steps["step"]) == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "r", "result.json"]


def test_dataloader_workers_forked_by_a_model_file_never_write(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "model = torch.nn.Linear(4, 1)\n"
        "data = TensorDataset(torch.randn(32, 4))\n"
        "def batches():\n"
        "    return DataLoader(data, batch_size=8, num_workers=2,\n"
        "                      multiprocessing_context='fork')\n"
        "def loss(model, batch):\n"
        "    return model(batch[0]).pow(2).mean()\n"
    )
    out = tmp_path / "r"
    code, _, err = _fpaudit(["scan", model, "--steps", 4, "--out", out])
    assert code == 0, err
    report = Report.read(out)
    assert report.complete and report.meta["steps_run"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "r"]


HOLDER = """
import sys, time
from fpaudit.report.files import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_lock_names_its_live_holder_and_dies_with_it(tmp_path: Path, cli) -> None:
    out = tmp_path / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        line = one_error_line(cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out))
        assert f"another fpaudit run (pid {holder.pid}) is writing {out}" in line
        assert "released when that process exits" in line
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the lock file stays
        holder.communicate()
    assert (tmp_path / "r.lock").exists()
    assert cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out).code == 0


def test_a_lock_file_naming_a_live_pid_does_not_block(tmp_path: Path, cli) -> None:
    # Before: a lock file with a reused pid (containers) or this very process's pid
    # blocked every run; only a live flock holder blocks now.
    import platform

    out = tmp_path / "r"
    (tmp_path / "r.lock").write_text(f"{os.getpid()} {platform.node()}\n")
    assert cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out).code == 0
    assert not (tmp_path / "r.lock").exists()


# -- 4. the kernel build cannot hang a scan ---------------------------------------------
def _build_directory(extensions: Path | None) -> Path:
    """The kernel's build directory under ``extensions`` (None: torch's default)."""
    code = "from fpaudit.kernels import build as kernels; print(kernels._build_directory())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True, env=env
    )
    return Path(found.stdout.strip())


def test_a_build_lock_left_by_a_killed_build_is_removed_and_the_kernel_loads(
    tmp_path: Path,
) -> None:
    # Before: torch waited for this lock forever; then every run took the pure-torch
    # path with a note for an hour. A Ctrl-C during the first import leaves one.
    extensions = tmp_path / "ext"
    directory = _build_directory(extensions)
    built = _build_directory(None)  # the suite's own build: copied, so ninja has nothing to do
    if any(built.glob("*.so")):
        shutil.copytree(
            built, directory, ignore=shutil.ignore_patterns("lock", "*.flock"), dirs_exist_ok=True
        )
    directory.mkdir(parents=True, exist_ok=True)
    baton = directory / "lock"
    baton.write_text("")  # what a build or load killed half-way leaves
    env = {"FPAUDIT_KERNEL": "cpp", "TORCH_EXTENSIONS_DIR": str(extensions)}  # cpp: no fallback
    code, _, err = _fpaudit(["scan", SAMPLES / "quadratic.py", "--steps", 1, "--out",
                             tmp_path / "r", "--device", "cpu"], **env)  # fmt: skip
    assert code == 0, err
    assert not [line for line in err.splitlines() if "lock" in line or "pure-torch" in line], err
    assert not baton.exists()
    assert list(directory.glob("*.so")), sorted(p.name for p in directory.iterdir())


def test_a_lock_is_judged_stale_only_while_no_compiler_works_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fpaudit.kernels import build as kernels

    monkeypatch.setattr(kernels, "SETTLE", 0.3)
    baton = tmp_path / "lock"
    baton.write_text("")
    start = time.monotonic()
    assert kernels._stale_lock(baton, deadline=start + 60, wait=60) is None
    assert not baton.exists() and time.monotonic() - start >= 0.3  # waited SETTLE first
    baton.write_text("")
    compiler = subprocess.Popen(["sleep", "60"], cwd=tmp_path)  # a live build there
    try:
        reason = kernels._stale_lock(baton, deadline=time.monotonic() + 1, wait=1)
    finally:
        compiler.kill()
        compiler.wait()
    assert reason is not None and "building it for over 1 s" in reason and baton.exists()


@pytest.mark.parametrize("builder", ["fpaudit", "compiler"])
def test_a_build_in_progress_elsewhere_is_waited_for_then_skipped(
    tmp_path: Path, builder: str
) -> None:
    """fpaudit: another fpaudit process holds the build flock. compiler: torch's lock
    with a compiler working in the build directory (an older fpaudit, without the
    flock): a live build, not a stale lock, so the lock stays."""
    extensions = tmp_path / "ext"
    directory = _build_directory(extensions)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "fpaudit.flock", os.O_CREAT | os.O_RDWR)
    compiler = None
    if builder == "fpaudit":
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live build holds it
    else:
        (directory / "lock").write_text("")
        compiler = subprocess.Popen(["sleep", "120"], cwd=directory)
    try:
        env = {"FPAUDIT_KERNEL": "auto", "TORCH_EXTENSIONS_DIR": str(extensions),
               "FPAUDIT_KERNEL_WAIT": "1"}  # fmt: skip
        code, _, err = _fpaudit(["scan", SAMPLES / "quadratic.py", "--steps", 1, "--out",
                                 tmp_path / "r", "--device", "cpu"], **env)  # fmt: skip
    finally:
        os.close(fd)
        if compiler is not None:
            compiler.kill()
            compiler.wait()
    assert code == 0, err
    notes = [line for line in err.splitlines() if "kernel" in line]
    assert len(notes) == 1 and "another process has been building it for over 1 s" in notes[0]
    assert (directory / "lock").exists() == (builder == "compiler")


# -- 6. every output error is one line, exit 2, the old report intact ------------------
@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` until at most ``leave`` bytes are free."""
    free = shutil.disk_usage(disk).free
    with (disk / "filler").open("wb") as handle, contextlib.suppress(OSError):
        handle.write(b"\0" * max(free - leave, 0))


def test_disk_full_is_one_line_and_the_old_report_stays(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        out = disk / "r"
        good = _good_report(out, steps=2)
        _fill(disk, leave=8192)  # room for the lock, not for a report
        code, _, err = _fpaudit(["scan", FAULTS, "--steps", 2, "--out", out, "--force"])
        assert code == 2, err
        line = _error_line(err)
        assert f"cannot write {out}: No space left on device" in line
        assert _same(Report.read(out), good)
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "r"]


def test_file_size_limit_is_one_line_and_the_old_report_stays(tmp_path: Path) -> None:
    out = tmp_path / "r"
    good = _good_report(out, steps=2)

    def limited() -> None:
        _default_signals()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    process = subprocess.Popen(
        [sys.executable, "-m", "fpaudit", "scan", str(FAULTS), "--steps", "2", "--out",
         str(out), "--force"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "FPAUDIT_KERNEL": "torch",
             "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=limited,
    )  # fmt: skip
    _, err = process.communicate(timeout=600)
    assert process.returncode == 2, err
    assert f"cannot write {out}: File too large" in _error_line(err)
    assert _same(Report.read(out), good)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_read_only_filesystem_is_one_line_and_the_old_report_stays(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        out = disk / "r"
        good = _good_report(out, steps=2)
        remounted = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
        if remounted.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remounted.stderr.decode().strip()}")
        code, _, err = _fpaudit(["scan", FAULTS, "--steps", 2, "--out", out, "--force"])
        assert code == 2, err
        assert f"cannot write {out}: Read-only file system" in _error_line(err)
        assert _same(Report.read(out), good)


@pytest.mark.parametrize("length", [250, 253])
def test_long_names_fit_the_staging_and_lock_names(tmp_path: Path, cli, length: int) -> None:
    # Before: the staging name ".<name>.XXXXXXXX.tmp" passed 255 bytes: internal error.
    out = tmp_path / ("n" * length)
    for _ in range(2):  # the second write replaces the first
        result = cli("scan", SAMPLES / "quadratic.py", "--steps", "1", "--out", out, "--force")
        assert result.code == 0, result.stderr
    assert Report.read(out).complete
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


# -- 8. model code cannot fake success ------------------------------------------------
@pytest.mark.parametrize(("do", "call"), [("exit:0", "sys.exit(0)"), ("_exit:0", "os._exit(0)")])
def test_an_exit_in_loss_is_an_error_that_keeps_the_completed_steps(
    tmp_path: Path, do: str, call: str
) -> None:
    # Before: sys.exit(0) in loss() made `scan` exit 0 with no report and no message.
    out = tmp_path / "r"
    code, _, err = _fpaudit(["scan", FAULTS, "--steps", 5, "--out", out],
                            FAULT_AT="step:2", FAULT_DO=do)  # fmt: skip
    assert code == 2, err
    line = _error_line(err)
    assert f"{FAULTS}:" in line and f"loss(model, batch) called {call}" in line
    assert f"the 2 completed step(s) are in {out}, marked incomplete" in line
    report = Report.read(out)
    assert report.meta["steps_run"] == 2 and not report.complete


def test_an_exit_in_loss_with_force_keeps_a_longer_report(tmp_path: Path) -> None:
    out = tmp_path / "r"
    good = _good_report(out, steps=3)
    code, _, err = _fpaudit(["scan", FAULTS, "--steps", 5, "--out", out, "--force"],
                            FAULT_AT="step:1", FAULT_DO="exit:0")  # fmt: skip
    assert code == 2, err
    assert "kept the existing report" in _error_line(err)
    assert _same(Report.read(out), good)
    gate = _fpaudit(["gate", out, "--max-underflow", "1"])
    assert gate[0] == 0  # the gate judges the intact, complete report it was given


def test_model_prints_do_not_corrupt_verify_json(tmp_path: Path) -> None:
    code, out, err = _fpaudit(["verify", FAULTS, "--scale", "2^10", "--json"],
                              FAULT_AT="verify", FAULT_DO="print")  # fmt: skip
    assert code in (0, 1), err
    assert json.loads(out)["passed"] in (True, False)
    assert "model code says hello" in err


def test_out_is_resolved_before_the_model_file_changes_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, _, err = _fpaudit(["scan", FAULTS, "--steps", 1, "--out", "rel"], cwd=tmp_path,
                            FAULT_AT="import", FAULT_DO=f"chdir:{elsewhere}")  # fmt: skip
    assert code == 0, err
    assert Report.read(tmp_path / "rel").complete
    assert list(elsewhere.iterdir()) == []


# -- 9. paths, threads, numbers and modes (issue 25) -----------------------------------
def _path_max() -> int:
    return int(os.pathconf("/", "PC_PATH_MAX"))


def _deep(root: Path, length: int) -> Path:
    """A path of exactly ``length`` bytes below ``root``, in names of at most 200."""
    parts: list[str] = []
    left = length - len(os.fsencode(root))
    while left > 0:
        size = min(200, left - 1)  # a "/" and the name
        parts.append("p" * size)
        left -= size + 1
    path = root.joinpath(*parts)
    assert len(os.fsencode(path)) == length
    return path


@pytest.mark.parametrize("command", ["scan", "run"])
def test_an_out_path_past_path_max_is_one_line_and_creates_nothing(
    tmp_path: Path, command: str
) -> None:
    # Before: a 4,447-byte --out ended in "internal error: OSError: [Errno 36] File name
    # too long" (PATH_MAX is 4096 on Linux; every name in it was short enough)
    out = _deep(tmp_path, 4447)
    if command == "scan":
        args: list[object] = ["scan", SAMPLES / "quadratic.py", "--steps", 1, "--out", out]
    else:
        args = ["run", "--out", out, "--", SAMPLES / "train_loop.py", "--steps", 1]
    code, _, err = _fpaudit(args)
    assert code == 2, err
    line = _error_line(err)
    assert "--out: the path" in line and "is 4447 bytes long" in line
    assert list(tmp_path.iterdir()) == []


def test_the_longest_out_path_allowed_writes_a_report(tmp_path: Path) -> None:
    # the limit leaves room for the report's files: a path at the limit works
    code, _, err = _fpaudit(["scan", SAMPLES / "quadratic.py", "--steps", 1, "--out",
                             _deep(tmp_path, _path_max() - 100)])  # fmt: skip
    assert code == 0, err
    written = list(tmp_path.rglob("meta.json"))
    assert len(written) == 1 and Report.read(written[0].parent).complete


THREADED = """import threading, time
import torch
from torch import nn

def _prefetch():  # a background prefetcher that never ends, started without daemon=True
    while True:
        time.sleep(0.05)

def model():
    threading.Thread(target=_prefetch, name="prefetcher").start()
    return nn.Linear(4, 2)

batches = [torch.ones(3, 4)] * 2

def loss(model, batch):
    return model(batch).square().mean()
"""


def test_a_model_file_thread_that_never_ends_does_not_hang_scan(tmp_path: Path) -> None:
    # Before: scan wrote the report and printed its summary, then waited forever for the
    # thread at interpreter exit
    (tmp_path / "model.py").write_text(THREADED)
    code, out, err = _fpaudit(
        ["scan", tmp_path / "model.py", "--steps", 2, "--out", tmp_path / "r"]
    )
    assert code == 0, err
    assert "Recommended static loss scale" in out
    assert "model code left 1 non-daemon thread(s) running ('prefetcher')" in err
    report = Report.read(tmp_path / "r")
    assert report.complete and report.meta["steps_run"] == 2


def test_run_waits_for_a_scripts_threads_as_python_does(tmp_path: Path) -> None:
    # `python script` waits for non-daemon threads; `fpaudit run` must not cut them off
    done = tmp_path / "done"
    (tmp_path / "train.py").write_text(
        "import threading, time, torch\n"
        "def finish():\n"
        "    time.sleep(1.0)\n"
        f"    open({str(done)!r}, 'w').write('saved')\n"
        "threading.Thread(target=finish).start()\n"
        "m = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "m(torch.ones(3, 2)).sum().backward()\n"
        "opt.step()\n"
    )
    code, _, err = _fpaudit(["run", "--out", tmp_path / "r", "--", tmp_path / "train.py"])
    assert code == 0, err
    assert done.read_text() == "saved" and "non-daemon" not in err


def test_a_huge_steps_run_is_one_line_in_a_real_process(tmp_path: Path) -> None:
    # Before: show, recommend and gate ended in "internal error: OverflowError"
    _good_report(tmp_path / "r", steps=1)
    meta_file = tmp_path / "r" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["steps_run"] = 10**400
    meta_file.write_text(json.dumps(meta))
    for args in (["show"], ["recommend"], ["gate", "--max-underflow", "1"]):
        code, _, err = _fpaudit([args[0], tmp_path / "r", *args[1:]])
        assert code == 2, err
        assert "meta.json: steps_run 1e+400 out of range 0..2147483647" in _error_line(err)


@pytest.mark.parametrize(("umask", "directory", "file"), [(0o022, 0o755, 0o644),
                                                          (0o027, 0o750, 0o640)])  # fmt: skip
def test_a_report_directory_gets_the_mode_mkdir_gives(
    tmp_path: Path, umask: int, directory: int, file: int
) -> None:
    # Before: the directory was 0700 (a mkdtemp renamed into place), its files 0644: a CI
    # artifact uploader or a teammate could not read it
    out = tmp_path / "r"
    environment = {**os.environ, "FPAUDIT_KERNEL": "torch"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "fpaudit", "scan", str(SAMPLES / "quadratic.py"), "--steps", "1",
         "--out", str(out)],
        env=environment, cwd=ROOT, capture_output=True, text=True, timeout=600,
        preexec_fn=lambda: os.umask(umask),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == directory
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {file}


def test_two_installs_of_the_same_kernel_source_build_apart(tmp_path: Path) -> None:
    """A second install (another venv or checkout) has its own build name: sharing one,
    each install rebuilt the kernel after the other had loaded it (the build records its
    source's path). The same install keeps its name, so its build is reused."""
    from fpaudit.kernels import build

    other = tmp_path / build.SOURCE.name
    other.write_bytes(build.SOURCE.read_bytes())
    here = build._name()
    assert build._name() == here
    original = build.SOURCE
    try:
        build.SOURCE = other
        assert build._name() != here and build._name().startswith("fpaudit_histogram_")
    finally:
        build.SOURCE = original


# -- no C++ compiler: the machine named, not the model ---------------------------------
def test_no_compiler_is_one_line_for_the_kernel_and_one_error_for_compile(tmp_path: Path) -> None:
    """Before: "building ... about a minute", torch's ``!! WARNING !!`` banner and
    ``ninja: build stopped`` for the kernel, then ``loss(model, batch) raised
    InductorError`` for ``--compile``: the model blamed for the machine. Now the kernel
    is not attempted (one note: the pure-torch path) and ``--compile`` stops with one
    line naming the compiler, exit 2. Scratch caches: nothing built or cached helps."""
    missing = tmp_path / "no-such-c++"
    env = {"CXX": str(missing), "FPAUDIT_KERNEL": "auto",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    code, _, err = _fpaudit(["scan", SAMPLES / "quadratic.py", "--compile", "--steps", 1,
                             "--out", tmp_path / "r", "--device", "cpu"], **env)  # fmt: skip
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"note: not using the CPU histogram kernel: no C++ compiler found (CXX={missing} is "
        "not an executable on PATH); using the pure-torch path: identical results, slower",
        lines[1],
    ], err
    assert lines[1].startswith(
        "fpaudit: error: no C++ compiler found: torch.compile (Inductor) needs one to "
        "compile the model ("
    ), err
    assert "InvalidCxxCompiler" in lines[1] and "raised" not in lines[1], err
    assert lines[1].endswith("; install one or point CXX at it"), err
    assert not (tmp_path / "r").exists()
