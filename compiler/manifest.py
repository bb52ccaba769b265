"""``DIR/manifest.json``: what a build directory holds and how it was made.

The manifest is a plain JSON object, schema-versioned (``schema_version``), written last
and atomically by every command that changes the directory. README documents each key.
"""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path
from typing import Any

from compiler import __version__
from compiler.errors import InputError
from compiler.files import atomic_write_json, read_json, sha256_files
from compiler.onnx_io import onnx_files
from compiler.specs import ModelSpec, parse_dim_range, parse_input_spec

__all__ = ["SCHEMA_VERSION", "MANIFEST", "read_manifest", "write_manifest", "tool_versions", "onnx_entry",
           "refuse_other_model", "now", "spec_from_manifest"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def tool_versions() -> dict[str, str]:
    versions = {"trtc": __version__, "python": platform.python_version()}
    for name in ("torch", "onnx", "onnxruntime", "polygraphy", "onnx_graphsurgeon"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        versions[name] = getattr(module, "__version__", "?")
    return versions


def onnx_entry(directory: Path, path: Path) -> dict[str, Any]:
    """A manifest entry for an ONNX file and its external data: relative names and one digest."""
    files = onnx_files(path)
    return {"file": path.relative_to(directory).as_posix(),
            "files": [f.relative_to(directory).as_posix() for f in files],
            "sha256": sha256_files(files),
            "bytes": sum(f.stat().st_size for f in files)}


def spec_from_manifest(manifest: dict[str, Any]) -> ModelSpec:
    """The input spec recorded by ``trtc export`` (``inputs`` and ``dims``)."""
    try:
        inputs = tuple(parse_input_spec(text) for text in manifest["inputs"])
        dims = dict(parse_dim_range(f"{name}={text}") for name, text in (manifest.get("dims") or {}).items())
    except (KeyError, TypeError) as err:
        raise InputError(f"the manifest has no usable input spec ({err}); re-export with `trtc export`") from err
    return ModelSpec(inputs, dims)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise InputError(f"{directory}: no {MANIFEST}; run `trtc export` or `trtc build` into it first")
    try:
        manifest = read_json(path)
    except ValueError as err:
        raise InputError(f"{path}: not valid JSON ({err}); rebuild the directory with `trtc build --force`") from err
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise InputError(f"{path}: schema_version {version!r}, this trtc reads {SCHEMA_VERSION}; rebuild the "
                         "directory with this version of trtc")
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    manifest = {"schema_version": SCHEMA_VERSION, **{k: v for k, v in manifest.items() if k != "schema_version"}}
    atomic_write_json(path, manifest)


def refuse_other_model(directory: Path, source_sha256: str, force: bool) -> None:
    """Refuse to write over a directory that holds a different model's build, unless ``force``."""
    path = directory / MANIFEST
    if force or not path.is_file():
        return
    try:
        old = read_json(path)
    except ValueError:
        return  # an unreadable manifest protects nothing
    old_sha = (old.get("source") or {}).get("sha256")
    if old_sha and old_sha != source_sha256:
        raise InputError(f"{directory} holds the build of another model ({(old.get('source') or {}).get('path')}); "
                         "choose another --out directory or pass --force to replace it")
