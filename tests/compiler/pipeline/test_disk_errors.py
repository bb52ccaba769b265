"""A full or read-only disk under --out: one line naming the path (and the space needed), exit 2, the old build kept.

The operating system reports both as an OSError with errno ENOSPC or EROFS from the write; these tests raise exactly
that error from the write trtc makes (``save_onnx``, the lock file), which runs the same error path.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.files import sha256_file

BUILD = ["build", "-q", "--model-factory", "examples.models:mlp", "--input", "x:Bx64", "--buckets", "1,4",
         "--engine", "none"]


def digests(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in output, output
    return lines[0]


def test_a_full_disk_while_rebuilding_keeps_the_old_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from save_onnx while building into a directory that holds a build: exit 2, one line naming the
    directory, the MiB free and needed, and every file of the old build byte for byte as it was, no staging left."""
    out = tmp_path / "m"
    first = CliRunner().invoke(cli, [*BUILD, "--out", str(out)])
    assert first.exit_code == 0, first.output
    before = digests(out)

    def full(model: object, path: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("compiler.pipeline.export.save_onnx", full)
    result = CliRunner().invoke(cli, [*BUILD, "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert "no space left" in line and str(out) in line and "MiB free" in line and "more than" in line
    assert digests(out) == before
    assert not list(out.glob(".staging-*"))


def test_a_read_only_out_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EROFS when the directory lock is created: exit 2, one line naming the path and the read-only file system, and
    no output directory left behind."""
    real_open = os.open

    def read_only(path: str | os.PathLike[str], *args: object, **kwargs: object) -> int:
        if str(path).endswith(".trtc.lock"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
    out = tmp_path / "ro"
    result = CliRunner().invoke(cli, [*BUILD, "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert "read-only file system" in line and str(out) in line
    assert not out.exists()
