"""Atomic writes, hashing and a directory lock.

A failed or killed run must leave the previous artifacts intact: every file is written to
a temporary name in the same directory and renamed into place (``os.replace`` is atomic on
POSIX), and the manifest is always the last file replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compiler.errors import DirectoryLocked

__all__ = ["sha256_file", "sha256_files", "atomic_write_bytes", "atomic_write_text", "atomic_write_json",
           "staging_dir", "commit_staged", "directory_lock", "read_json"]

LOCK_NAME = ".trtc.lock"


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """One digest over several files (a graph and its external data), in the given order."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(bytes.fromhex(sha256_file(p)))
    return h.hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
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
    out_dir.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def commit_staged(staged: Path, out_dir: Path, last: str = "manifest.json") -> list[str]:
    """Move every file of ``staged`` into ``out_dir`` (subfolders kept), ``last`` at the very end.

    Each move is an atomic rename. Returns the relative paths moved.
    """
    files = sorted(p for p in staged.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.relative_to(staged).as_posix() == last)
    moved = []
    for src in files:
        rel = src.relative_to(staged)
        dst = out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        moved.append(rel.as_posix())
    return moved


def _lock_holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        return f"pid {info['pid']} on {info['host']} ({info.get('command', '?')})"
    except (OSError, ValueError, KeyError):
        return "another process"


@contextlib.contextmanager
def directory_lock(out_dir: Path, command: str) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` for the duration of a build.

    Uses ``fcntl.flock`` on ``DIR/.trtc.lock``, so a killed process releases it. The lock file
    records who holds it, so the second process can say so.
    """
    import fcntl

    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir / LOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryLocked(f"{out_dir} is being written by {_lock_holder(lock_path)}; "
                                  "wait for it to finish or choose another --out directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command}).encode())
        for leftover in out_dir.glob(".staging-*"):  # from a run that was killed; only the lock holder stages
            shutil.rmtree(leftover, ignore_errors=True)
        yield
    finally:
        if created and [p.name for p in out_dir.iterdir()] == [LOCK_NAME]:
            # a run that failed before writing anything leaves no trace, not even the directory
            lock_path.unlink()
            out_dir.rmdir()
        os.close(fd)
