"""The directory a report lives in: pinned reads, staging, the atomic swap, and the output lock.

A report is written to a staging directory beside the target, fsynced and renamed into
place (exchanged atomically where the kernel can), so a crash never leaves a half-written
report; a reader pins the directory it opened, so a swap during a read is seen.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from fpaudit._process import Owner
from fpaudit.errors import Named, ReportError, ReportExists
from fpaudit.report.outputs import (
    STAGING_SUFFIX,
    current_umask,
    hidden_sibling,
    make_parent,
    staging_prefix,
)
from fpaudit.report.schema import META_FILE


class Pin:
    """One report directory held open while it is read.

    Every file is opened through the held directory (``/proc/self/fd/N/...``), so a
    read cannot mix the metadata of one report with a table of the report that
    replaced it. Whether a failed read met a replacement is asked of the held
    directory itself: is it still the one at the path, and still linked? Comparing
    inode numbers taken before and after is not enough, because a replacement that
    deletes the old directory frees its inode for the next one.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd: int | None = None
        self.base = root
        try:
            self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            self.start = _identity(root)  # missing or not a directory: said by _read_once
            return
        held = Path(f"/proc/self/fd/{self.fd}")
        if held.is_dir():  # Linux; elsewhere paths go through the name as before
            self.base = held
        self.start = _identity(root)

    def still_at(self, root: Path) -> bool:
        """True when the directory read is still the report at ``root`` (the error is real)."""
        if self.fd is None:
            return _identity(root) == self.start
        held = os.fstat(self.fd)
        return held.st_nlink > 0 and _identity(root) == (held.st_dev, held.st_ino)

    def renamed(self, error: ReportError | OSError) -> ReportError:
        """``error`` as a ``ReportError`` naming the report's path, not the held directory's."""
        if isinstance(error, OSError):
            where = error.filename or self.base
            error = ReportError(f"{where}: cannot read ({error.strerror or error})")
        if self.base == self.root:
            return error
        return ReportError(str(error).replace(str(self.base), str(self.root)))

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _identity(root: Path) -> tuple[int, int] | None:
    """Which directory ``root`` names now (a replacement swaps in another)."""
    try:
        found = os.stat(root)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


def check_target(path: str | os.PathLike[str], force: bool) -> Path:
    """``path`` as a report target: new, or an fpaudit report that ``force`` may replace.

    A replacement that a crash cut short between its two renames (only where
    ``renameat2`` is unavailable) left the old report as ``.<name>.old``: it is put
    back first, so the target is never lost.
    """
    target = Path(path)
    if not target.name or target.name in (".", ".."):
        raise ReportError(f"{target} is not a name for a report directory")
    recover(target)
    if target.exists() or target.is_symlink():
        if not force:
            raise ReportExists(target)
        if not target.is_dir() or not (target / META_FILE).is_file():
            raise ReportError(
                f"{target} exists and is not an fpaudit report; refusing to replace it"
            )
    return target


def recover(target: Path) -> bool:
    """Put back a report that an interrupted replacement left at ``.<name>.old``."""
    retired = hidden_sibling(target, ".old")
    if target.exists() or target.is_symlink() or not (retired / META_FILE).is_file():
        return False
    with contextlib.suppress(OSError):
        os.rename(retired, target)
        return True
    return False


def steps_in(target: Path) -> int | None:
    """The completed steps of the report at ``target`` (from its metadata), or None."""
    try:
        meta = json.loads((target / META_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    done = meta.get("steps_run") if isinstance(meta, dict) else None
    return done if isinstance(done, int) and not isinstance(done, bool) else None


def new_staging(target: Path) -> Path:
    """A fresh hidden directory beside ``target`` to write into."""
    make_parent(target, "out")
    staging = Path(
        tempfile.mkdtemp(prefix=staging_prefix(target), suffix=STAGING_SUFFIX, dir=target.parent)
    )
    staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700: mkdir's mode instead
    return staging


def finish(staging: Path, target: Path) -> None:
    """Sync ``staging`` and move it into place (an old report stays until then)."""
    owner = _OWNERS.get(_key(target))
    if owner is not None and not owner.here():
        raise ReportError(
            f"{target}: this process (pid {os.getpid()}) is a fork of the audit's process "
            f"(pid {owner.pid}); only that process writes the report"
        )
    for directory in [staging, *(p for p in staging.iterdir() if p.is_dir())]:
        fsync(directory)
    _replace_dir(staging, target)


@contextlib.contextmanager
def output_errors(target: Path) -> Iterator[None]:
    """Turn an operating-system error while writing ``target`` into one ``ReportError``."""
    try:
        yield
    except ReportError:
        raise
    except (OSError, pa.ArrowException) as error:
        raise ReportError(f"cannot write {target}: {_reason(error)}") from error


def _reason(error: BaseException) -> str:
    """What went wrong, in the operating system's words (pyarrow wraps them in its own)."""
    if isinstance(error, OSError) and error.strerror:
        name = error.filename if isinstance(error.filename, str) else None
        where = f" ({Path(name).name})" if name else ""
        code = error.errno
        text = os.strerror(code) if code is not None and code in errno.errorcode else None
        return f"{text or error.strerror}{where}"
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    for code in (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.EIO):
        if os.strerror(code).lower() in text.lower():
            return os.strerror(code)
    return text


# Which process started the audit of each locked target: a forked child neither
# writes the report nor releases the lock.
_OWNERS: dict[str, Owner] = {}


def _key(target: Path) -> str:
    return os.path.abspath(target)


class OutputLock:
    """``<target>.lock``, held with ``fcntl.flock`` on an open descriptor for the run.

    The kernel releases a flock when its process dies, however it dies, so a lock
    file left by a killed run never blocks (no pid liveness test: pids are reused,
    in containers above all). The file holds the owner's pid and host, for the
    message a second run prints. Only the process that took the lock releases it:
    a forked child (``os.fork``, a DataLoader worker) shares the descriptor but
    never unlocks.
    """

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = Path(target)
        self.path = _lock_path(self.target)
        self.owner = Owner()
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        with output_errors(self.target):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read_text(self.path).split()
                    os.close(fd)
                    pid = (
                        f"pid {holder[0]}" if holder and holder[0].isdigit() else "another process"
                    )
                    raise ReportError(
                        f"another fpaudit run ({pid}) is writing {self.target}; wait for it to "
                        "finish or stop it, or choose another ",
                        Named("out"),
                        f" (lock: {self.path}; it is released when that process exits)",
                    ) from None
                except BaseException:
                    os.close(fd)
                    raise
                # The file may have been unlinked by its last owner between our open and
                # flock: then the lock we hold is on a file nobody else sees. Retry.
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            else:  # pragma: no cover - lost the race ten times
                raise ReportError(f"could not lock {self.path}")
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {platform.node()}\n".encode())
        self._fd = fd
        self.owner = Owner()
        _OWNERS[_key(self.target)] = self.owner
        return self

    def owned(self) -> bool:
        """True in the process that took the lock (False in a forked child)."""
        return self.owner.here()

    def __exit__(self, *exc: object) -> None:
        if self._fd is None or not self.owned():
            return  # a forked child: the lock is its parent's
        _OWNERS.pop(_key(self.target), None)
        with contextlib.suppress(OSError):
            self.path.unlink()  # before unlocking: a waiter then finds a fresh file
        os.close(self._fd)  # releases the flock
        self._fd = None


def output_lock(target: str | os.PathLike[str]) -> OutputLock:
    """Hold ``<target>.lock`` while a run writes ``target``: a second run refuses."""
    return OutputLock(target)


def _lock_path(target: Path) -> Path:
    name = f"{target.name}.lock"
    if len(os.fsencode(name)) <= 255:
        return target.with_name(name)
    return hidden_sibling(target, ".lock")


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``; an old report stays intact until the new one is in place.

    On Linux the two directories are swapped in one ``renameat2(RENAME_EXCHANGE)``:
    ``target`` always names a whole report, the old one or the new. Elsewhere (or on
    a filesystem without it) the old report is renamed to ``.<name>.old`` first;
    should the process die between the two renames, the next write to ``target``
    (``check_target``) puts it back.
    """
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now the old report
    else:
        retired = hidden_sibling(target, ".old")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(target, retired)
        os.rename(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    fsync(target.parent)


_RENAME_EXCHANGE = 2


_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2; False where that is unsupported."""
    if os.environ.get("FPAUDIT_NO_RENAME_EXCHANGE") == "1":  # tests take the other path
        return False
    function = _renameat2()
    if function is None:
        return False
    result = function(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]  # fmt: skip
    function.restype = ctypes.c_int
    return function
