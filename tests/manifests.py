"""The manifest as the JSON file it is, for tests that read or change the file format itself (a tampered path, a
damaged key, a build section of another trtc); everything else goes through ``compiler.core.manifest``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compiler.core.files import atomic_write_json
from compiler.core.manifest import MANIFEST, SCHEMA_VERSION

__all__ = ["manifest_json", "write_manifest_json"]


def manifest_json(directory: Path) -> dict[str, Any]:
    """``directory/manifest.json`` as the JSON object it holds."""
    data: dict[str, Any] = json.loads((Path(directory) / MANIFEST).read_text())
    return data


def write_manifest_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as a manifest file at ``path``, ``schema_version`` first (unless ``data`` gives its own)."""
    atomic_write_json(path, {"schema_version": SCHEMA_VERSION, **data})
