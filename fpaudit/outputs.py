"""One rule for where fpaudit writes: the parent folder of every output (a report of
``scan`` or ``run``, a lock beside it, ``plot -o``, ``gate --junit``) is created as
``mkdir -p`` would; one that cannot be is one line naming the folder and why."""

from __future__ import annotations

from pathlib import Path

from fpaudit.errors import UsageError

__all__ = ["make_parent"]


def make_parent(path: Path, option: str) -> Path:
    """Create ``path``'s parent folders (like ``mkdir -p``); ``option`` names the flag
    in the error, e.g. ``--out``. Returns the parent."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where a folder should be
        raise UsageError(f"{option}: cannot create folder {parent}: a file is in the way") from None
    except OSError as error:
        raise UsageError(
            f"{option}: cannot create folder {parent} ({error.strerror or error})"
        ) from None
    return parent
