"""How fpaudit writes: one rule for folders, one for names, one atomic writer.

Every output (a report of ``scan`` or ``run``, a lock beside it, ``plot -o``,
``gate --junit``) has its parent folders created as ``mkdir -p`` would; one that
cannot be is one line naming the folder and why (:func:`make_parent`). What is
being written is staged under a hidden name beside the target
(:func:`hidden_sibling`, within any filesystem's 255-byte limit), synced, and
renamed over it: a reader sees the old file or the new one, never half of one.
A file is written by :func:`write_atomically`; a report, a directory, stages the
same way (``fpaudit.report.store``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from fpaudit.errors import Named, UsageError

__all__ = [
    "STAGING_SUFFIX",
    "check_creatable",
    "hidden_sibling",
    "make_parent",
    "staging_prefix",
    "write_atomically",
]

STAGING_SUFFIX = ".tmp"


def symlink_loop(path: Path) -> Path | None:
    """The first part of ``path`` that is a symbolic link leading back to itself (the
    system gives up following it: ELOOP), or None. Such a path neither exists nor can be
    created, and ``Path.resolve`` raises on it."""
    here = Path(path.anchor) if path.is_absolute() else Path()
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        here = here / part
        try:
            os.stat(here)
        except OSError as error:
            return here if error.errno == errno.ELOOP else None
    return None


def loop_words(loop: Path) -> str:
    """How a message names a symlink loop."""
    return (
        f"{loop} is a symbolic link that leads back to itself (a symlink loop); "
        "remove or re-point it"
    )


def make_parent(path: Path, option: str) -> Path:
    """Create ``path``'s parent folders (like ``mkdir -p``); ``option`` names the option
    that gave ``path`` in the error, e.g. ``out`` (the CLI says ``--out``). Returns the
    parent."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where a folder should be
        raise _in_the_way(option, parent) from None
    except OSError as error:
        raise UsageError(
            Named(option), f": cannot create folder {parent} ({error.strerror or error})"
        ) from None
    return parent


def _in_the_way(option: str, folder: Path, blocker: Path | None = None) -> UsageError:
    """The one wording of a file where an output's folder should be."""
    which = f" ({blocker})" if blocker is not None else ""
    return UsageError(
        Named(option), f": cannot create folder {folder}: a file is in the way{which}"
    )


def _path_max() -> int:
    """The longest path the system opens (PATH_MAX, 4096 on Linux)."""
    try:
        return int(os.pathconf("/", "PC_PATH_MAX"))
    except (OSError, ValueError, AttributeError):
        return 4096


def check_creatable(path: Path, option: str, *, given: str, inside: int = 0) -> None:
    """Check, creating nothing, that the absolute ``path`` (``given`` as the user spelled
    it) can be made by :func:`make_parent` and a write: no symlink loop, a path within
    the system's limit with ``inside`` bytes to spare (the files a report puts in it),
    no file where a folder should be, every new name within its filesystem's limit.
    Each problem is one :class:`~fpaudit.errors.UsageError` naming ``option``."""
    loop = symlink_loop(path)
    if loop is not None:
        raise UsageError(Named(option), f" {given}: {loop_words(loop)}")
    length = len(os.fsencode(path))
    if length + inside > _path_max():
        raise UsageError(
            Named(option), f": the path {given[:40]}... is {length} bytes long; with the "
            f"report's files inside it, this system allows {_path_max() - inside}"
        )  # fmt: skip
    for parent in path.parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise _in_the_way(option, path.parent, parent)
        try:
            longest = os.pathconf(parent, "PC_NAME_MAX")
        except (OSError, ValueError):
            longest = 255
        for part in path.relative_to(parent).parts:
            if len(os.fsencode(part)) > longest:
                raise UsageError(
                    Named(option), f": the name {part[:40]}... is {len(os.fsencode(part))} "
                    f"bytes long; this filesystem allows {longest}"
                )  # fmt: skip
        return


def hidden_sibling(target: Path, suffix: str) -> Path:
    """A hidden name beside ``target`` within any filesystem's 255-byte name limit.

    ``.<name><suffix>`` when that is short; long names keep a readable head and a
    hash of the whole, so two targets never share a sibling.
    """
    name = f".{target.name}{suffix}"
    if len(os.fsencode(name)) <= 200:
        return target.with_name(name)
    digest = hashlib.sha256(os.fsencode(target.name)).hexdigest()[:16]
    head = os.fsencode(target.name)[:100].decode(errors="ignore")
    return target.with_name(f".{head}-{digest}{suffix}")


def staging_prefix(target: Path) -> str:
    """The prefix of a staging name for ``target`` (``mkstemp``/``mkdtemp`` add a random
    part and :data:`STAGING_SUFFIX`): ``.<name>.XXXXXXXX.tmp``."""
    return hidden_sibling(target, ".").name


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object],
                     *, option: str) -> Path:  # fmt: skip
    """Write a file: ``write`` fills a staging file beside ``path``, which is synced and
    renamed over ``path`` (any old file stays intact until then, and whatever ``write``
    raises leaves no staging file behind). Missing folders are created; the file gets
    the mode a plain ``open`` would (0666 less the umask). An operating-system error is
    one :class:`~fpaudit.errors.UsageError` that names ``option`` (as :func:`make_parent`)
    and the file."""
    target = Path(path)
    parent = make_parent(target, option)
    if target.is_dir():
        raise UsageError(Named(option), f": {target} is a directory")
    try:
        descriptor, staging = tempfile.mkstemp(
            prefix=staging_prefix(target), suffix=STAGING_SUFFIX, dir=parent
        )
    except OSError as error:
        raise UsageError(
            Named(option), f": cannot write in {parent} ({error.strerror or error})"
        ) from None
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(staging, 0o666 & ~current_umask())  # mkstemp makes it 0600
        os.replace(staging, target)
    except BaseException as error:
        Path(staging).unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = error.strerror or error
            raise UsageError(Named(option), f": cannot write {target} ({reason})") from None
        raise
    return target


def current_umask() -> int:
    """The process's umask (read by setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
