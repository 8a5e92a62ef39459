"""Installing fpaudit keeps the torch a user already has.

A fresh venv gets only a supported torch (the release these tests run on, or
``FPAUDIT_INSTALL_TORCH``, e.g. ``torch==2.10.0``), then the wheel built from this
checkout, with its dependencies, as ``pip install`` does it for a user. The torch
there must be the same distribution afterwards (version and files untouched), and
the installed fpaudit must run a scan. ``make test-release`` checks the same on
each supported registry release.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """The command's stdout (its stderr is shown only when it fails)."""
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=900, env=env, cwd=cwd
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_pip_install_keeps_the_users_torch(tmp_path: Path) -> None:
    spec = os.environ.get("FPAUDIT_INSTALL_TORCH", f"torch=={torch.__version__.split('+')[0]}")
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", wheels, ROOT)
    (wheel,) = wheels.glob("fpaudit-*.whl")

    # the user's environment sees none of this checkout (a PYTHONPATH to it would make
    # pip think fpaudit is already installed)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_dir = tmp_path / "user-env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", spec, env=env)
    probe = "import torch, os; print(torch.__version__, os.path.getmtime(torch.__file__))"
    before = _run(python, "-c", probe, env=env).strip()

    log = _run(python, "-m", "pip", "install", wheel, env=env)
    after = _run(python, "-c", probe, env=env).strip()
    assert after == before, log
    assert "Uninstalling torch" not in log and "Collecting torch" not in log, log

    # the installed package (not this checkout) scans a model, C++ kernel source included
    out = tmp_path / "report"
    scan = _run(
        env_dir / "bin" / "fpaudit", "scan", ROOT / "sample_configs" / "quadratic.py",
        "--steps", "1", "--out", out, env=env,
    )  # fmt: skip
    assert (out / "records.parquet").is_file(), scan
    where = "import fpaudit, pathlib; print(pathlib.Path(fpaudit.__file__).parent)"
    located = _run(python, "-c", where, env=env, cwd=tmp_path)  # not this checkout's copy
    package = Path(located.strip())
    assert package.is_relative_to(env_dir), located
    assert (package / "kernels" / "_histogram_kernel.cpp").is_file()
