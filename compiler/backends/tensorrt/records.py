"""Build settings and engines as the manifest stores them: ``build``, ``environment`` and ``engines``.

One rule each for writing ``manifest["build"]`` (``settings_to_dict``), reading it back for ``trtc rebuild``
(``settings_from_dict``), the TF32 policy it records (``recorded_tf32``) and the keys an engine build writes
(``manifest_engine_keys``). Pure Python: nothing here needs TensorRT.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.settings import BuildSettings

__all__ = ["settings_to_dict", "settings_from_dict", "recorded_tf32", "manifest_engine_keys"]

log = logging.getLogger(__name__)


def settings_to_dict(settings: BuildSettings) -> dict[str, Any]:
    """``BuildSettings`` as ``manifest["build"]``: JSON values (lists, strings) under the field names."""
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
    """``BuildSettings`` from ``manifest["build"]``; keys this trtc does not know are ignored (with a note)."""
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
