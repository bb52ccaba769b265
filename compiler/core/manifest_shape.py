"""The shape of ``manifest.json``'s JSON: the keys commands read, checked once (``malformed``), so that a damaged
or hand-edited manifest is one InputError in ``compiler.core.manifest`` rather than a TypeError deep in a reader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["malformed"]


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
            and ("files" not in entry or _list_of(entry["files"], str, nonempty=True))
            and ("file_sha256" not in entry or (isinstance(entry["file_sha256"], dict)
                                                and all(_is(v, str) for v in entry["file_sha256"].values()))))


def _engine_ok(entry: Any) -> bool:
    if not (isinstance(entry, dict) and _is(entry.get("bucket"), int) and entry["bucket"] > 0 and _entry_ok(entry)):
        return False
    layers = entry.get("layers")
    return ((_is(entry.get("profile", 0), int) and entry.get("profile", 0) >= 0)
            and ("shapes" not in entry or _shapes_ok(entry["shapes"]))
            and (layers is None or (isinstance(layers, dict) and _is(layers.get("file"), str)))
            and all(_is(entry.get(k, ""), str) for k in ("onnx", "onnx_sha256")))


def malformed(m: Mapping[str, Any]) -> str | None:
    """What is wrong with the shape of manifest ``m``, or None. Keys that are absent are not checked here."""
    if not isinstance(m, Mapping):
        return "it is not a JSON object"
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
