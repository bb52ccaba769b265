"""Atomic writes, hashing, a directory lock, and paths confined to a directory.

A failed or killed run must leave the previous artifacts intact: every file is written to
a temporary name in the same directory and renamed into place (``os.replace`` is atomic on
POSIX), and the manifest is always the last file replaced. A path that a directory's records
name is used only inside that directory (``inside``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from compiler.core.errors import DirectoryLocked, InputError

__all__ = ["sha256_file", "sha256_files", "atomic_write_bytes", "atomic_write_text", "atomic_write_json",
           "staging_dir", "commit_staged", "directory_lock", "directory_transaction", "Transaction", "read_json",
           "file_mode", "current_umask", "settle_modes", "require_directory", "inside", "space_for", "write_failure"]

LOCK_NAME = ".trtc.lock"
FULL = (errno.ENOSPC, errno.EDQUOT)  # a full file system or a used-up quota: free space, or write elsewhere
READ_ONLY = (errno.EROFS,)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path], digests: list[str] | None = None) -> str:
    """One digest over several files (a graph and its external data), in the given order; ``digests``: each file's
    own sha256 where already known (not read again)."""
    h = hashlib.sha256()
    for p, digest in zip(paths, digests or [sha256_file(p) for p in paths]):
        h.update(p.name.encode())
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def inside(directory: Path, relpath: Any, what: str = "file") -> Path:
    """``directory / relpath`` for a path read from a manifest or ``calibration.json``, confined to ``directory``.

    The path must be a plain relative POSIX path: not absolute, no ``..``, no backslash or drive, and
    it must not resolve (through symlinks) outside ``directory``. Anything else is an InputError:
    a build directory is shared, so what its files say must not make trtc read, write or delete
    anything else. Does not check that the file exists.
    """
    directory = Path(directory)
    text = relpath if isinstance(relpath, str) else None
    bad = (text is None or not text or "\x00" in text or "\\" in text or text.startswith("/")
           or ":" in text.split("/")[0] or any(part in ("..", "") for part in text.split("/")))
    if not bad:
        path = directory / PurePosixPath(text or "")
        try:
            bad = not path.resolve().is_relative_to(directory.resolve())
        except (OSError, RuntimeError):  # a symlink loop
            bad = True
    if bad:
        raise InputError(f"{directory}: the {what} {relpath!r} named in its records leaves the directory (not a "
                         "relative path inside it: absolute, '..' or a symlink out of it); refusing it: restore the "
                         "manifest or rebuild the directory with `trtc build`")
    return path


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def write_failure(err: OSError, directory: Path, needed: int | None = None) -> InputError | None:
    """The one-line InputError for an OSError the user fixes outside trtc, or None for any other OSError.

    ``ENOSPC``/``EDQUOT`` (a full disk or quota): the path, the space free there and, with ``needed`` (bytes of the
    write that failed), how much more it needs. ``EROFS``: the path lies on a read-only file system. These come from
    the operating system on the real write; tests raise them from the write itself (an ``OSError`` with that
    ``errno``), which is the same path through this function."""
    where = Path(err.filename) if isinstance(err.filename, (str, os.PathLike)) else directory
    if err.errno in READ_ONLY:
        return InputError(f"{where}: a read-only file system, so {directory} cannot be written; choose another "
                          "--out directory on a writable disk")
    if err.errno not in FULL:
        return None
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = 0
    need = (f"writing {_mib(needed)} needs {_mib(max(needed - free, 1))} more than the {_mib(free)} free"
            if needed else f"{_mib(free)} free")
    return InputError(f"no space left on the disk of {directory} ({where}; {need}); free space there or choose "
                      "another --out directory (the directory's previous contents are unchanged)")


@contextlib.contextmanager
def space_for(directory: Path, nbytes: int) -> Iterator[None]:
    """Around a write of about ``nbytes`` into ``directory``: a full disk or quota becomes ``write_failure``'s
    InputError naming the bytes it needs; other errors pass unchanged."""
    try:
        yield
    except OSError as err:
        failure = write_failure(err, directory, nbytes) if err.errno in FULL else None
        if failure is None:
            raise
        raise failure from err


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``os.umask`` sets it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask (0644 under 022)."""
    return 0o666 & ~current_umask()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place, with the usual file mode.

    ``mkstemp`` creates its file 0600; the final file gets what ``open()`` would give it under the
    umask, so a build directory is readable by the users and containers it is shared with.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path) as f:
        return json.load(f)


@contextlib.contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A scratch directory inside ``out_dir`` (same filesystem, so renames are atomic).

    It is removed on exit whether or not the work succeeded; call ``commit_staged`` inside
    the block to move the results into ``out_dir``.
    """
    require_directory(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def commit_staged(staged: Path, out_dir: Path, last: str = "manifest.json") -> list[str]:
    """Move every file of ``staged`` into ``out_dir`` (subfolders kept), ``last`` at the very end.

    Each move is an atomic rename. Every file gets the usual mode under the umask first (0644 under
    022), whatever wrote it: temporary files and onnx's external data are created 0600, and a build
    directory is read by other users (a Triton container, a CI job). Returns the relative paths moved.
    """
    files = sorted(p for p in staged.rglob("*") if p.is_file())
    settle_modes(files)
    files.sort(key=lambda p: p.relative_to(staged).as_posix() == last)
    moved = []
    for src in files:
        rel = src.relative_to(staged)
        dst = out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        moved.append(rel.as_posix())
    return moved


def settle_modes(files: list[Path]) -> None:
    """Give each file the mode ``open()`` would give it under the current umask."""
    mode = file_mode()
    for path in files:
        os.chmod(path, mode)


def _lock_holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        return f"pid {info['pid']} on {info['host']} ({info.get('command', '?')})"
    except (OSError, ValueError, KeyError):
        return "another process"


def require_directory(path: Path, option: str = "--out") -> None:
    """InputError unless ``path`` is a directory or does not exist yet (an output directory to create)."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} exists and is not a directory; choose a directory for the output ({option})")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{parent} is a file, so {path} cannot be created; choose another output "
                                 f"directory ({option})")
            break


def _locked(lock_path: Path, out_dir: Path) -> int:
    """An fd holding ``flock`` on ``lock_path``, the file that is at that path now.

    The holder removes the lock file when it finishes, so a waiter may have opened a file that is
    no longer there; it then opens the new one (the usual check of flock on files that get unlinked).
    """
    import fcntl

    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryLocked(f"{out_dir} is being written by {_lock_holder(lock_path)}; "
                                  "wait for it to finish or choose another --out directory") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def directory_lock(out_dir: Path, command: str) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` for the duration of a build.

    Uses ``fcntl.flock`` on ``DIR/.trtc.lock``, so a killed process releases it. The lock file
    records who holds it, so the second process can say so; it is removed when the command ends,
    so a finished directory holds only its artifacts. ``out_dir`` naming a file is an InputError.
    """
    require_directory(out_dir)
    created = not out_dir.exists()
    lock_path = out_dir / LOCK_NAME
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = _locked(lock_path, out_dir)
    except OSError as err:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        failure = write_failure(err, out_dir)
        if failure is None and err.errno in (errno.EACCES, errno.EPERM):
            failure = InputError(f"{err.filename or out_dir}: permission denied, so {out_dir} cannot be written; "
                                 "choose another --out directory or fix its permissions")
        if failure is None:
            raise
        raise failure from err
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command}).encode())
        for leftover in out_dir.glob(".staging-*"):  # from a run that was killed; only the lock holder stages
            shutil.rmtree(leftover, ignore_errors=True)
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # still held: a waiter that opened it sees it is gone and retries
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a run that failed before writing anything leaves no trace, not even the directory
        os.close(fd)


class Transaction:
    """What a command writing a build directory sees inside ``directory_transaction``.

    Write every new file under ``stage`` (the manifest as ``stage / "manifest.json"``); name files of
    the previous build that the new manifest no longer lists with ``remove_after_commit``.
    """

    def __init__(self, directory: Path, stage: Path) -> None:
        self.directory = directory
        self.stage = stage
        self.committed: list[str] = []
        self._obsolete: list[str | os.PathLike[str]] = []
        self._done = False

    def remove_after_commit(self, names: Iterable[str | os.PathLike[str]]) -> None:
        """Delete these files (relative to the directory, or paths checked to be inside it) after the manifest."""
        self._obsolete += list(names)

    def commit(self) -> list[str]:
        """Move the staged files into the directory, manifest last, then delete the obsolete files.

        Called by ``directory_transaction`` when its block ends without an exception; call it earlier
        only to work on the committed directory while still holding the lock. Returns the files moved.
        """
        if not self._done:
            self._done = True
            self.committed = commit_staged(self.stage, self.directory)
            for name in self._obsolete:
                (self.directory / name).unlink(missing_ok=True)
        return self.committed


@contextlib.contextmanager
def directory_transaction(out_dir: Path, command: str) -> Iterator[Transaction]:
    """Lock ``out_dir``, stage inside it, and commit the staged files manifest last if the block succeeds.

    The one way a command writes a build directory: ``directory_lock`` (a second writer is refused,
    naming ``command``), a ``staging_dir`` on the same filesystem, and ``Transaction.commit`` when the
    block ends normally (a ``return`` inside it too). An exception or a kill leaves the directory as it
    was (the staging folder is removed, or cleaned by the next lock holder); an error the caller wants to
    report *after* committing (say, the accuracy report of a failed gate) is raised after the block.
    """
    try:
        with directory_lock(out_dir, command), staging_dir(out_dir) as stage:
            transaction = Transaction(out_dir, stage)
            yield transaction
            transaction.commit()
    except OSError as err:  # a full or read-only disk anywhere in the block: one line, the old contents kept
        failure = write_failure(err, out_dir) if err.errno in FULL + READ_ONLY else None
        if failure is None:
            raise
        raise failure from err
