"""Snapshot what the command line prints, to show a refactor changed none of it.

Writes one file per invocation into DIR: every command's ``--help`` and the text and
``--json`` output of the report-reading commands on two small reports (a two-step
scan with a block-scaled recipe and ``--origins``, and a short ``fpaudit run``), built
once into ``DIR/reports`` and reused. Run it before a change and after it into
another folder, then ``diff -r`` the two (the reports are the same files, so
every difference is the change's)::

    python tools/snapshot_outputs.py /tmp/before            # on main
    python tools/snapshot_outputs.py /tmp/after --reports /tmp/before/reports
    diff -r -x reports /tmp/before /tmp/after

Everything runs in this one process (the CLI's ``run``), at 100 columns.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _reports(folder: Path) -> tuple[Path, Path]:
    """The scan report and the run report in ``folder``, made when missing."""
    folder.mkdir(parents=True, exist_ok=True)
    scan, run = folder / "scan", folder / "run"
    fpaudit = [sys.executable, "-m", "fpaudit"]
    if not scan.exists():
        subprocess.run(
            [*fpaudit, "scan", str(ROOT / "sample_configs/transformer.py"), "--steps", "2",
             "--format", "fp16", "--format", "fp8_e5m2", "--recipe", "mxfp8-e4m3",
             "--origins", "--out", str(scan), "--device", "cpu"],
            check=True, capture_output=True,
        )  # fmt: skip
    if not run.exists():
        subprocess.run(
            [*fpaudit, "run", "--out", str(run), "--",
             str(ROOT / "sample_configs/train_loop.py"), "--steps", "40", "--bugs"],
            check=True, capture_output=True,
        )  # fmt: skip
    for report in (scan, run):  # diff and gate --baseline refuse a report against itself
        if not (copy := folder / f"{report.name}-copy").exists():
            shutil.copytree(report, copy)
    return scan, run


def _invocations(scan: Path, run: Path) -> dict[str, list[str]]:
    """Snapshot name -> argv."""
    from fpaudit.cli.commands import COMMANDS

    calls: dict[str, list[str]] = {"help": ["--help"]}
    for name, _function, _settings in COMMANDS:
        calls[f"help-{name}"] = [name, "--help"]
    s, r, c = str(scan), str(run), str(scan.parent / "scan-copy")
    per_report = {
        "show": [["show"], ["show", "--by", "op"], ["show", "--kind", "grad"],
                 ["show", "--scale", "recommended", "--top", "3"], ["show", "--origins"],
                 ["show", "--recipe", "mxfp8-e4m3"], ["show", "--format", "fp8_e5m2"]],
        "recommend": [["recommend"], ["recommend", "--worst-window"],
                      ["recommend", "--format", "fp8_e5m2"], ["recommend", "--drift-window", "1"]],
        "simulate": [["simulate"], *[["simulate", "--policy", p] for p in
                     ("apex", "deepspeed", "megatron", "static", "te-delayed",
                      "msamp-delayed")],
                     ["simulate", "--policy", "te-delayed", "--sweep"],
                     ["simulate", "--init-scale", "2^10", "--growth-interval", "3"]],
        "gate": [["gate", "--max-underflow", "0.001"],
                 ["gate", "--max-underflow", "0.5", "--per-module"],
                 ["gate", "--max-underflow", "0.5", "--allow-incomplete", "--allow-errors"],
                 ["gate", "--recipe", "mxfp8-e4m3", "--max-flush", "0.01"]],
        "plan": [["plan", "--max-flush", "0.01"], ["plan", "--max-flush", "0.5", "--names"]],
    }  # fmt: skip
    for label, report in (("scan", s), ("run", r)):
        for variants in per_report.values():
            for argv in variants:
                for json in ([], ["--json"]):
                    if json and "--names" in argv:
                        continue
                    name = "-".join([label, *argv, *json]).replace("--", "")
                    calls[name] = [argv[0], report, *argv[1:], *json]
    calls["run-show-steps"] = ["show", r, "--steps"]
    calls["run-show-steps-json"] = ["show", r, "--steps", "--json"]
    for json in ([], ["--json"]):
        tail = "-json" if json else ""
        calls[f"formats{tail}"] = ["formats", *json]
        calls[f"recipes{tail}"] = ["recipes", *json]
        calls[f"diff{tail}"] = ["diff", s, c, *json]
        calls[f"diff-run{tail}"] = ["diff", r, f"{r}-copy", *json]
        calls[f"diff-recipe{tail}"] = ["diff", s, c, "--recipe", "mxfp8-e4m3", *json]
        calls[f"gate-baseline{tail}"] = ["gate", s, "--baseline", c, "--max-increase", "0.01",
                                         *json]  # fmt: skip
    calls["error-simulate-policy"] = ["simulate", s, "--policy", "nope"]
    calls["error-gate-limit"] = ["gate", s]
    return {re.sub(r"[^A-Za-z0-9_.^-]", "_", k): v for k, v in calls.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write the snapshot into")
    parser.add_argument("--reports", type=Path, help="where the reports are (default OUT/reports)")
    args = parser.parse_args()
    os.environ["COLUMNS"] = "100"
    args.out.mkdir(parents=True, exist_ok=True)
    scan, run = _reports(args.reports or args.out / "reports")
    from fpaudit.cli.commands import run as fpaudit

    for name, argv in _invocations(scan, run).items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = fpaudit(argv)
        text = f"$ fpaudit {' '.join(argv)}\nexit {code}\n--- stdout\n{out.getvalue()}"
        text += f"--- stderr\n{err.getvalue()}"
        (args.out / f"{name}.txt").write_text(text.replace(str(scan.parent), "REPORTS"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
