"""``DIR/manifest.json``: what a build directory holds and how it was made.

The manifest is a plain JSON object, schema-versioned (``schema_version``), written last
and atomically by every command that changes the directory. docs/manifest.md documents each key.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.files import atomic_write_json, inside, read_json, sha256_file, sha256_files
from compiler.core.onnx_io import onnx_files
from compiler.core.settings import BuildSettings
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.core.version import __version__

__all__ = ["SCHEMA_VERSION", "MANIFEST", "read_manifest", "write_manifest", "tool_versions", "onnx_entry",
           "refuse_other_model", "now", "spec_from_manifest", "verified_onnx", "verified_file", "onnx_for",
           "settings_to_dict", "settings_from_dict", "recorded_tf32", "manifest_engine_keys"]

log = logging.getLogger(__name__)

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


def verified_file(directory: Path, entry: dict[str, Any], what: str = "file") -> Path:
    """The confined ``entry["file"]`` after checking that it exists and matches ``entry["sha256"]``."""
    path = inside(directory, entry.get("file") if isinstance(entry, dict) else None, what)
    if not path.is_file():
        raise InputError(f"{path} is missing: the directory is incomplete; rebuild it with `trtc rebuild {directory}`")
    if sha256_file(path) != entry.get("sha256"):
        raise InputError(f"{path} does not match the sha256 in {directory / MANIFEST} (changed or truncated); "
                         f"rebuild it with `trtc rebuild {directory}` or `trtc build`")
    return path


def verified_onnx(directory: Path, entry: Any, precision: str = "") -> Path:
    """The confined graph of a manifest ``onnx`` entry, after its files (graph + data) match the entry's sha256.

    Every file is checked inside ``directory`` and read only after the digest over all of them
    matches; the graph's external data references are checked to be among those files.
    """
    what = f"{precision} ONNX".strip()
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise InputError(f"{directory / MANIFEST}: the {what} entry lacks file or sha256; rebuild the directory "
                         "with `trtc build`")
    names = entry.get("files") or [entry.get("file")]
    if not isinstance(names, list) or entry.get("file") not in names:
        raise InputError(f"{directory / MANIFEST}: the {what} entry's files do not include its graph; rebuild the "
                         "directory with `trtc build`")
    files = [inside(directory, name, what) for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{', '.join(missing)} missing: the directory's ONNX is incomplete; restore it or "
                         "re-run `trtc build`")
    graph = files[names.index(entry["file"])]
    if sha256_files(files) != entry["sha256"]:
        raise InputError(f"{graph} does not match the sha256 in the manifest: it was changed after export, so it "
                         "is not the verified model; restore it or re-run `trtc build` to re-export")
    referenced = {p.resolve() for p in onnx_files(graph)}
    if not referenced <= {f.resolve() for f in files}:
        raise InputError(f"{graph} refers to data files the manifest does not list; re-run `trtc build`")
    return graph


def onnx_for(directory: Path, manifest: Mapping[str, Any], precision: str | None = None) -> Path:
    """The build's ONNX for ``precision`` (default: the build's ``precision``, else fp32), confined to ``directory``
    and checked against its sha256."""
    precision = precision or manifest.get("precision") or "fp32"
    onnx = manifest.get("onnx")
    entry = onnx.get(precision) if isinstance(onnx, dict) and isinstance(precision, str) else None
    if entry is None:
        raise InputError(f"{directory}: the manifest's precision is {precision} but it lists no onnx.{precision} "
                         "file; run `trtc build` into the directory again")
    return verified_onnx(directory, entry, str(precision))


def spec_from_manifest(manifest: dict[str, Any]) -> ModelSpec:
    """The input spec recorded by ``trtc export`` (``inputs`` and ``dims``)."""
    try:
        inputs = tuple(parse_input_spec(text) for text in manifest["inputs"])
        dims = dict(parse_dim_range(f"{name}={text}") for name, text in (manifest.get("dims") or {}).items())
    except (KeyError, TypeError, AttributeError) as err:
        raise InputError(f"the manifest has no usable input spec ({err}); re-export with `trtc export`") from err
    return ModelSpec(inputs, dims)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise InputError(f"{directory}: no {MANIFEST}; run `trtc export` or `trtc build` into it first")
    try:
        manifest = read_json(path)
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not valid JSON ({err}); rebuild the directory with `trtc build --force`") from err
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise InputError(f"{path}: schema_version {version!r}, this trtc reads {SCHEMA_VERSION}; rebuild the "
                         "directory with this version of trtc")
    problem = _malformed(manifest)
    if problem:
        raise InputError(f"{path}: {problem}; the manifest is damaged, rebuild the directory with `trtc build`")
    for what, name in _paths_in(manifest):
        inside(Path(directory), name, what)
    return manifest


# The shape of the keys that commands read, checked once when the manifest is read so that a damaged or
# hand-edited manifest is one InputError rather than a TypeError deep in a reader. Hand-written: a dozen type
# checks on one JSON object do not justify a schema library as a runtime dependency.

def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, (int, float)))


def _list_of(value: Any, kind: type, nonempty: bool = False) -> bool:
    return isinstance(value, list) and all(_is(v, kind) for v in value) and (bool(value) or not nonempty)


def _counts(value: Any) -> bool:
    return _list_of(value, int, nonempty=True) and min(value) > 0


def _shapes_ok(shapes: Any) -> bool:
    return isinstance(shapes, dict) and all(
        isinstance(s, dict) and all(_list_of(s.get(k), int, nonempty=True) for k in ("min", "opt", "max"))
        for s in shapes.values())


def _entry_ok(entry: Any) -> bool:
    """An ``onnx`` entry or a snapshot record: file and sha256 strings, files a list of strings."""
    return (isinstance(entry, dict) and _is(entry.get("file"), str) and _is(entry.get("sha256"), str)
            and ("files" not in entry or _list_of(entry["files"], str, nonempty=True)))


def _engine_ok(entry: Any) -> bool:
    if not (isinstance(entry, dict) and _is(entry.get("bucket"), int) and entry["bucket"] > 0 and _entry_ok(entry)):
        return False
    layers = entry.get("layers")
    return ((_is(entry.get("profile", 0), int) and entry.get("profile", 0) >= 0)
            and ("shapes" not in entry or _shapes_ok(entry["shapes"]))
            and (layers is None or (isinstance(layers, dict) and _is(layers.get("file"), str)))
            and all(_is(entry.get(k, ""), str) for k in ("onnx", "onnx_sha256")))


def _malformed(m: dict[str, Any]) -> str | None:
    """What is wrong with the shape of manifest ``m``, or None. Keys that are absent are not checked here."""
    source, build = m.get("source", {}), m.get("build") or {}
    checks = {
        "inputs": lambda: _list_of(m["inputs"], str, nonempty=True),
        "dims": lambda: isinstance(m["dims"], dict) and all(_is(v, str) for v in m["dims"].values()),
        "output_names": lambda: _list_of(m["output_names"], str),
        "buckets": lambda: _counts(m["buckets"]),
        "precision": lambda: _is(m["precision"], str),
        "source": lambda: isinstance(source, dict) and all(_is(source.get(k, ""), str)
                                                           for k in ("path", "format", "factory", "sha256"))
        and ("snapshot" not in source or _entry_ok(source["snapshot"])),
        "onnx": lambda: isinstance(m["onnx"], dict) and all(_entry_ok(e) for e in m["onnx"].values()),
        "build": lambda: isinstance(build, dict) and ("buckets" not in build or _counts(build["buckets"]))
        and all(build.get(k) is None or _is(build[k], str) for k in ("precision", "timing_cache", "engine")),
        "engines": lambda: isinstance(m["engines"], list) and all(_engine_ok(e) for e in m["engines"]),
        "environment": lambda: m["environment"] is None or isinstance(m["environment"], dict),
        "engines_note": lambda: m["engines_note"] is None or _is(m["engines_note"], str),
    }
    for key, ok in checks.items():
        if key in m and not ok():
            if key == "engines" and isinstance(m["engines"], list):
                index = next(i for i, e in enumerate(m["engines"]) if not _engine_ok(e))
                return f"engines[{index}] lacks bucket, file or sha256, or has a value of the wrong type"
            return f"'{key}' is malformed"
    return None


def _paths_in(m: dict[str, Any]) -> list[tuple[str, Any]]:
    """(what, relative path) of every file a well-formed manifest names."""
    paths: list[tuple[str, Any]] = []
    for precision, entry in (m.get("onnx") or {}).items():
        paths += [(f"{precision} ONNX", name) for name in entry.get("files") or [entry["file"]]]
    for entry in m.get("engines") or []:
        paths.append(("engine", entry["file"]))
        if entry.get("layers"):
            paths.append(("layer file", entry["layers"]["file"]))
    snapshot = (m.get("source") or {}).get("snapshot")
    if snapshot:
        paths.append(("source model snapshot", snapshot["file"]))
    return paths


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    manifest = {"schema_version": SCHEMA_VERSION, **{k: v for k, v in manifest.items() if k != "schema_version"}}
    atomic_write_json(path, manifest)


# --- the build settings as the manifest stores them ---------------------------------------------------------------

def settings_to_dict(settings: BuildSettings) -> dict[str, Any]:
    """``BuildSettings`` as the manifest's ``build``: JSON values (lists, strings) under the field names."""
    out = dataclasses.asdict(settings)
    out["buckets"] = list(settings.buckets)
    out["timing_cache"] = str(settings.timing_cache) if settings.timing_cache is not None else None
    return out


def recorded_tf32(build: Any) -> bool:
    """Whether FP32 math may use TF32 for a build: its ``tf32``; a build section without one (a trtc that did not
    record it) built with TF32 off; no build section (or not a mapping: the manifest's checks name that): the
    default. One rule for ``trtc rebuild`` and for the serving and bench backends."""
    if not isinstance(build, dict):
        return defaults.TF32
    return bool(build.get("tf32", False))


def settings_from_dict(data: dict[str, Any]) -> BuildSettings:
    """``BuildSettings`` from the manifest's ``build``; keys this trtc does not know are ignored (with a note)."""
    known = {f.name for f in dataclasses.fields(BuildSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        log.info("manifest build settings %s are unknown to this trtc and ignored", ", ".join(unknown))
    values = {k: v for k, v in data.items() if k in known}
    values["tf32"] = recorded_tf32(data)
    if "buckets" in values:
        values["buckets"] = tuple(int(b) for b in values["buckets"])
    if values.get("timing_cache") is not None:
        values["timing_cache"] = Path(values["timing_cache"])
    try:
        return BuildSettings(**values)
    except TypeError as err:
        raise InputError(f"manifest build settings do not parse ({err}); rebuild with `trtc build --force`") from err


def manifest_engine_keys(settings: BuildSettings, env: dict[str, Any], entries: list[dict[str, Any]],
                         ) -> dict[str, Any]:
    """The manifest keys an engine build writes: ``build`` (the settings, so ``trtc rebuild`` can repeat
    them), ``environment`` (where the engines were built, for ``trtc check``) and ``engines``."""
    return {"build": settings_to_dict(settings),
            "environment": {**env, "hardware_compat": settings.hardware_compat,
                            "version_compatible": settings.version_compatible},
            "engines": entries}


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
