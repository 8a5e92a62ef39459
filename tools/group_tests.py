"""Group the tests by room: tests/ follows the tree of fpaudit/ (issue 23).

A test lives in the room of the code it tests: ``tests/rules/`` for ``fpaudit/rules/``,
``tests/cli/`` for ``fpaudit/cli/``, and so on (docs/architecture.md names the rooms).
Tests of the package's top level (``errors.py``, ``torch_internals*.py``) stay in
``tests/`` itself, as those modules stay in ``fpaudit/``; tests of the whole product
(the architecture, the docs, installing, the bad-input battery, the samples, ...) go to
``tests/project/``. The shared helpers (conftest.py, oracle.py, reports.py, models/,
scripts/, data/) stay in ``tests/``.

``ROOMS`` below is the layout, one line per test file. Running this script

- fails, naming them, if a ``test_*.py`` in tests/ or a room folder is not in ``ROOMS``
  (add a line there, or pass ``--map test_x.py=room`` for a one-off),
- ``git mv``s each test file that is not where ``ROOMS`` puts it, giving each room
  folder an ``__init__.py``,
- rewrites what depends on a test's place: the relative imports of the test files
  (``from .conftest`` -> ``from ..conftest``; ``from .test_y`` -> ``from ..run.test_y``),
  ``Path(__file__)`` parents in a moved file, and every ``tests/test_x.py`` path and
  ``tests.test_x`` module name in the tracked text files (Makefile, docs, pyproject,
  sources), except CHANGELOG.md, whose lines are history,
- sorts the imports it rewrote with ruff, where ruff is installed.

It is idempotent: on a grouped tree it changes nothing. Run it from anywhere:

    python tools/group_tests.py            # group, printing each move and rewrite
    python tools/group_tests.py --dry-run  # print what it would do, change nothing
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
TOP = "."  # the room of a test of the package's top level: tests/ itself

# What each room folder's __init__.py says.
FOLDERS = {
    "numerics": "fpaudit/numerics/: formats, recipes, the bin layout.",
    "report": "fpaudit/report/: the report's tables, files, checks and metadata.",
    "kernels": "fpaudit/kernels/: tensors to exact counts (C++, Triton, block statistics).",
    "rules": "fpaudit/rules/: the pure functions over a report's tables.",
    "capture": "fpaudit/capture/: the audit of autograd and modules, autocast, compile.",
    "run": "fpaudit/run/: running the user's code (scan, verify, run, fp16-plan, ranks).",
    "integrations": "fpaudit/integrations/: the Lightning and Hugging Face callbacks.",
    "cli": "fpaudit/cli/: the command line, its options, config, rendering, CI, plots.",
    "project": "the whole product: its shape, sizes, docs, install, samples, batteries.",
}

# test file -> room folder under tests/ (TOP: tests/ itself). The room is where the code
# under test lives; a test of several rooms goes where its assertions point.
ROOMS = {
    # fpaudit/ top level: the private-torch seam, the errors' wording
    "test_torch_seam.py": TOP,
    "test_error_wording.py": TOP,
    "test_signals.py": TOP,  # _signals.py: SIGINT and SIGTERM held back where state changes
    # numerics/
    "test_formats.py": "numerics",
    "test_layout.py": "numerics",
    # report/
    "test_report.py": "report",
    "test_runinfo.py": "report",
    "test_outputs.py": "report",  # report/outputs.py: folders, the atomic writer
    "test_fuzz.py": "report",  # report/checks.py: what every read checks
    "test_reliability.py": "report",  # report/files.py: incomplete runs, the output lock
    # kernels/
    "test_histogram.py": "kernels",
    "test_histogram_many.py": "kernels",
    "test_histogram_narrow.py": "kernels",
    "test_triton_kernel.py": "kernels",
    "test_triton_bound.py": "kernels",
    "test_blockstats.py": "kernels",
    "test_blockstats_sr.py": "kernels",
    "test_blockstats_torchao.py": "kernels",
    # rules/
    "test_analysis.py": "rules",
    "test_comparison.py": "rules",
    "test_scale_oracle.py": "rules",  # the prediction at 2**k against a real backward
    "test_unscalable.py": "rules",
    "test_origins.py": "rules",
    "test_fp16_models.py": "rules",  # the origin rule on decoders that break in fp16
    "test_plan_gemm.py": "rules",  # rules/blockplan.py: GEMM operands only
    "test_scalers.py": "rules",
    "test_simulation.py": "rules",
    "test_delayed.py": "rules",
    "test_misuse_rules.py": "rules",  # rules/findings.py
    "test_summaries.py": "rules",  # rules/summary.py: what the commands print, computed
    # capture/
    "test_capture.py": "capture",
    "test_audit_lifecycle.py": "capture",
    "test_twins.py": "capture",  # checkpointing and hooks against plain twins
    "test_live.py": "capture",  # --amp, the fp32 shadow, the forward phase
    "test_autocast.py": "capture",
    "test_compiled.py": "capture",
    "test_compiled_zoo.py": "capture",
    "test_metrics.py": "rules",
    "test_tensorboard.py": "integrations",
    "test_trackers.py": "integrations",
    "test_torch_patches.py": "capture",  # capture/_torch_patches.py
    # run/
    "test_batches.py": "run",  # run/modelfile.py
    "test_verify.py": "run",
    "test_fp16plan.py": "run",
    "test_hf_architectures.py": "run",  # scan, gate and fp16-plan on real architectures
    "test_training.py": "run",
    "test_transparency.py": "run",
    "test_distributed.py": "run",
    # integrations/
    "test_integrations.py": "integrations",
    # cli/
    "test_cli.py": "cli",
    "test_help.py": "cli",
    "test_options.py": "cli",
    "test_config.py": "cli",
    "test_config_unit.py": "cli",
    "test_render.py": "cli",
    "test_render_wording.py": "cli",
    "test_ci.py": "cli",
    "test_diff.py": "cli",
    "test_plot.py": "cli",
    "test_blocks_cli.py": "cli",  # scan/show/gate/plan --recipe end to end
    # project/: the whole product
    "test_architecture.py": "project",
    "test_sizes.py": "project",
    "test_signatures.py": "project",
    "test_docs.py": "project",
    "test_install.py": "project",
    "test_release_identity.py": "project",
    "test_benchmarks.py": "project",
    "test_samples.py": "project",
    "test_battery.py": "project",
    "test_evidence.py": "project",  # each case of issue 12 through a real process
    "test_faults.py": "project",  # signals, forks, locks, full disks, across the product
}

# Never rewritten: the changelog's lines are history, and this file names old places.
UNTOUCHED = {"CHANGELOG.md", "tools/group_tests.py"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".txt", ".yml", ".yaml", ".sh", ""}


def fail(message: str) -> None:
    sys.exit(f"group_tests: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print, change nothing")
    parser.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="TEST=ROOM",
        help="an extra line of ROOMS, e.g. test_summaries.py=report (repeatable)",
    )
    return parser.parse_args(argv)


def layout(extra: list[str]) -> dict[str, str]:
    rooms = dict(ROOMS)
    for item in extra:
        name, sep, room = item.partition("=")
        if not sep or not re.fullmatch(r"test_\w+\.py", name):
            fail(f"--map {item!r}: expected test_NAME.py=ROOM")
        rooms[name] = room
    bad = {n: r for n, r in rooms.items() if r != TOP and r not in FOLDERS}
    if bad:
        fail(f"unknown rooms {bad}; known: {TOP}, {', '.join(FOLDERS)}")
    return rooms


def where_now() -> dict[str, Path]:
    """Each test file's place now: tests/ or one room folder (a name twice is an error)."""
    found: dict[str, Path] = {}
    places = [TESTS, *(TESTS / room for room in FOLDERS)]
    for place in places:
        for path in sorted(place.glob("test_*.py")):
            if path.name in found:
                fail(f"{path.name} is in two places: {rel(found[path.name])} and {rel(path)}")
            found[path.name] = path
    return found


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def target(name: str, rooms: dict[str, str]) -> Path:
    room = rooms[name]
    return TESTS / name if room == TOP else TESTS / room / name


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


# -- rewriting ------------------------------------------------------------------------------

FILE_PARENTS = re.compile(
    r"Path\(__file__\)(\.resolve\(\))?((?:\.parent\b)+(?!s)|\.parents\[(\d+)\])"
)
RELATIVE_IMPORT = re.compile(r"^(\s*from )(\.+)([\w.]*)( import )", re.M)


def helpers() -> set[str]:
    """What test files import from tests/ itself: conftest, oracle, reports, models, ..."""
    names = {p.stem for p in TESTS.glob("*.py") if not p.name.startswith("test_")}
    names |= {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in FOLDERS}
    return names - {"__init__", "__pycache__"}


def depth(path: Path) -> int:
    """How deep a file's folder is below the repository: tests/ is 1, tests/rules/ is 2."""
    return len(path.parent.relative_to(REPO).parts)


def moved_parents(text: str, old: Path, new: Path) -> str:
    """``Path(__file__)...parent`` chains that name the same folder from the new place."""

    def repoint(match: re.Match[str]) -> str:
        resolve, chain, index = match.group(1) or "", match.group(2), match.group(3)
        up = int(index) + 1 if index is not None else chain.count(".parent")
        named = depth(old) - (up - 1)  # the depth of the folder the chain names
        new_up = depth(new) - named + 1
        if new_up < 1:
            fail(f"{rel(new)}: {match.group(0)} would name a folder above the repository")
        suffix = ".parent" if new_up == 1 else f".parents[{new_up - 1}]"
        return f"Path(__file__){resolve}{suffix}"

    return FILE_PARENTS.sub(repoint, text)


def relative_imports(text: str, path: Path, rooms: dict[str, str], shared: set[str]) -> str:
    """Each relative import of a helper or a test module, spelled from ``path``'s place."""
    below = depth(path) - 1  # 0 in tests/, 1 in a room folder

    def respell(match: re.Match[str]) -> str:
        head, _dots, module, tail = match.groups()
        parts = module.split(".") if module else []
        if not parts:
            fail(f"{rel(path)}: `from . import ...` names no module; import from one instead")
        test = next((p for p in parts if p.startswith("test_")), None)
        if test is not None:
            room = rooms.get(f"{test}.py")
            if room is None:
                fail(f"{rel(path)} imports {test}, which is not in ROOMS")
            here = "." if path.parent == TESTS else path.parent.name
            if room == here:
                return f"{head}.{test}{tail}"
            inner = test if room == TOP else f"{room}.{test}"
            return f"{head}{'.' * (below + 1)}{inner}{tail}"
        if parts[0] in shared:
            return f"{head}{'.' * (below + 1)}{module}{tail}"
        return match.group(0)  # a module of the file's own folder

    return RELATIVE_IMPORT.sub(respell, text)


def references(text: str, rooms: dict[str, str]) -> str:
    """Paths (``tests/test_x.py``, ``tests/rules/test_x.py``) and module names
    (``tests.test_x``) of test files, each naming the file's room."""
    folders = "|".join(FOLDERS)

    def path(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in rooms:
            return match.group(0)
        return "tests/" + (name if rooms[name] == TOP else f"{rooms[name]}/{name}")

    def module(match: re.Match[str]) -> str:
        name = match.group(2)
        if f"{name}.py" not in rooms:
            return match.group(0)
        room = rooms[f"{name}.py"]
        return "tests." + (name if room == TOP else f"{room}.{name}")

    text = re.sub(rf"(?<![\w.-])tests/(?:({folders})/)?(test_\w+\.py)\b", path, text)
    return re.sub(rf"(?<![\w.])tests\.(?:({folders})\.)?(test_\w+)\b", module, text)


def tracked_text_files() -> Iterable[Path]:
    for name in git("ls-files", "-z").split("\0"):
        if not name or name in UNTOUCHED:
            continue
        path = REPO / name
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            yield path


def write(path: Path, old: str, new: str, why: str, dry: bool) -> bool:
    if new == old:
        return False
    print(f"  rewrite {rel(path)}: {why}")
    if not dry:
        path.write_text(new)
    return True


def sort_imports(paths: list[Path], dry: bool) -> None:
    """ruff puts the rewritten imports in order (``..`` before ``.``) and formats them."""
    ruff = Path(sys.executable).parent / "ruff"
    command = str(ruff) if ruff.exists() else shutil.which("ruff")
    if not paths or dry:
        return
    if command is None:
        print("  ruff not found: run `ruff check --select I --fix tests` to sort the imports")
        return
    names = [rel(p) for p in paths]
    subprocess.run([command, "check", "--quiet", "--select", "I", "--fix", *names], cwd=REPO)
    subprocess.run([command, "format", "--quiet", *names], cwd=REPO)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rooms = layout(args.map)
    now = where_now()
    unknown = sorted(set(now) - set(rooms))
    if unknown:
        lines = "\n".join(f"  {rel(now[n])}" for n in unknown)
        fail(
            f"{len(unknown)} test file(s) with no room in ROOMS (tools/group_tests.py):\n"
            f"{lines}\nadd a line to ROOMS for each, or pass --map test_NAME.py=ROOM"
        )
    for name in sorted(set(rooms) - set(now)):
        print(f"note: {name} is in ROOMS but not in tests/ (removed?)")

    moves = {n: (p, target(n, rooms)) for n, p in now.items() if p != target(n, rooms)}
    shared = helpers()
    touched: list[Path] = []
    for room in sorted({rooms[n] for n in now} - {TOP}):
        init = TESTS / room / "__init__.py"
        if not init.exists():
            print(f"create {rel(init)}")
            if not args.dry_run:
                init.parent.mkdir(exist_ok=True)
                init.write_text(f'"""Tests of {FOLDERS[room]}"""\n')
                git("add", rel(init))
    for old, new in sorted(moves.values(), key=lambda m: (str(m[1].parent), m[1].name)):
        print(f"git mv {rel(old)} {rel(new)}")
        if not args.dry_run:
            git("mv", rel(old), rel(new))
        here = old if args.dry_run else new
        text = here.read_text()
        if write(here, text, moved_parents(text, old, new), "Path(__file__)", args.dry_run):
            touched.append(here)
    # Every test file's relative imports, from where it is now (or will be).
    for name, path in sorted(now.items()):
        here = path if args.dry_run else target(name, rooms)
        text = here.read_text()
        fixed = relative_imports(text, target(name, rooms), rooms, shared)
        if write(here, text, fixed, "relative imports", args.dry_run):
            touched.append(here)
    # Every path and module name of a test file, in every tracked text file.
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        changed = write(path, text, references(text, rooms), "test paths", args.dry_run)
        if changed and path.suffix == ".py" and path.is_relative_to(TESTS):
            touched.append(path)
    sort_imports(touched, args.dry_run)
    print(f"{len(moves)} test file(s) moved" if moves else "already grouped: nothing moved")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
