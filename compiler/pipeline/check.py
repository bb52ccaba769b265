"""``trtc check`` and ``trtc rebuild``: can a directory's engines run here, and rebuilding the ones that cannot.

An engine runs only where three things hold (TensorRT's "Engine Compatibility" documentation):

* the same TensorRT version built it (major, minor, patch and build), unless it was built
  version-compatible: then any later runtime of the same major runs it, and a TensorRT 11 runtime
  runs a version-compatible TensorRT 10 engine (the one cross-major pair the support matrix lists);
* the GPU model that built it (an engine built for an H100 is not run on an H200 or GH200, though all
  three are compute capability 9.0: TensorRT tunes it to the device), unless built hardware-compatible:
  ``--hardware-compat same-compute-capability`` runs on any GPU of the same compute capability,
  ``--hardware-compat`` (``ampere-plus``) on any GPU of compute capability 8.0 or later;
* the file is the one the manifest records (its sha256), on the platform that built it.

A rebuild uses only what the directory holds: the ONNX files (checked against their recorded
sha256) and the recorded build settings. Nothing is re-exported or recalibrated, so quantization
scales stay exactly as they were.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from compiler.backends.trt_build import (
    BuildStep,
    build_engine_files,
    environment,
    manifest_engine_keys,
    parse_compute_capability,
    settings_from_dict,
)
from compiler.core.errors import InputError
from compiler.core.files import commit_staged, directory_lock, sha256_file, staging_dir
from compiler.core.manifest import (
    MANIFEST,
    inside,
    now,
    read_manifest,
    spec_from_manifest,
    verified_onnx,
    write_manifest,
)
from compiler.core.settings import BuildSettings, hardware_compat_level

__all__ = ["Staleness", "CheckResult", "RebuildResult", "stale_engines", "check_directory", "rebuild_directory",
           "merge_manifests", "tensorrt_can_run", "gpu_can_run", "NEVER_BUILT"]

log = logging.getLogger(__name__)

NEVER_BUILT = "engines never built (TensorRT was not available at build time)"
# build settings that change what an engine is; engines merged into one directory must agree on them
_ENGINE_SETTINGS = ("precision", "multi_profile", "workspace_mib", "opt_level", "hardware_compat",
                    "version_compatible", "tf32")


@dataclass(frozen=True)
class Staleness:
    """Why the engine of ``bucket`` (file ``file``) cannot run here; bucket and file are None for the directory."""

    bucket: int | None
    file: str | None
    reason: str

    def __str__(self) -> str:
        if self.bucket is None:
            return self.reason
        return f"bucket {self.bucket} ({self.file}): {self.reason}"


@dataclass(frozen=True)
class CheckResult:
    """What ``trtc check DIR`` found: exit code 0 when every engine can run here, 1 when some cannot."""

    directory: Path
    environment: dict[str, Any]
    fresh: list[dict[str, Any]] = field(default_factory=list)  # manifest entries that can run here
    stale: list[Staleness] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.stale else 0

    def lines(self) -> list[str]:
        """One line per engine, for the CLI to print."""
        lines = [f"ok     bucket {e['bucket']} ({e['file']})" for e in self.fresh]
        lines += [f"stale  {s}" for s in self.stale]
        if self.stale:
            lines.append(f"rebuild with `trtc rebuild {self.directory} --if-stale`")
        return lines


@dataclass(frozen=True)
class RebuildResult:
    directory: Path
    rebuilt: bool
    stale_before: list[Staleness]
    engines: list[dict[str, Any]]


# --- compatibility rules -----------------------------------------------------------------------------------------

def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def tensorrt_can_run(built: str, running: str, version_compatible: bool) -> bool:
    """Whether TensorRT ``running`` can load an engine that TensorRT ``built`` made."""
    if built == running:
        return True
    if not version_compatible:
        return False
    old, new = _version_tuple(built), _version_tuple(running)
    if not old or not new or new < old:
        return False
    return new[0] == old[0] or (old[0], new[0]) == (10, 11)


def gpu_can_run(built: dict[str, Any], running: dict[str, Any], hardware_compat: str | bool) -> bool:
    """Whether the GPU of ``running`` can run an engine built on the GPU of ``built`` at a hardware-compatibility
    level (``settings.HARDWARE_COMPAT_LEVELS``; a bool from an older manifest: True was ampere-plus).

    Both are environment records (``gpu`` name, ``compute_capability`` "9.0"). ``none``: the same compute
    capability and the same GPU model (when both names are known); ``same-compute-capability``: the same
    compute capability; ``ampere-plus``: any compute capability 8.0 or later.
    """
    level = hardware_compat_level(hardware_compat)
    made, here = built.get("compute_capability"), running.get("compute_capability")
    if level == "ampere-plus":
        capability = parse_compute_capability(here)
        return capability is not None and capability >= (8, 0)
    if made != here:
        return False
    if level == "same-compute-capability":
        return True
    return not (built.get("gpu") and running.get("gpu")) or built["gpu"] == running["gpu"]


def _environment_reasons(built: dict[str, Any], here: dict[str, Any], build: dict[str, Any]) -> list[str]:
    """Reasons, shared by every engine of the directory, why they cannot run in ``here``."""
    reasons = []
    version_compatible = bool(build.get("version_compatible", built.get("version_compatible")))
    hardware_compat = hardware_compat_level(build.get("hardware_compat", built.get("hardware_compat")))
    made, running = built.get("tensorrt"), here.get("tensorrt")
    if running is None:
        reasons.append(f"TensorRT is not installed here (built with TensorRT {made})")
    elif made is None:
        reasons.append("the manifest does not record which TensorRT built the engines")
    elif not tensorrt_can_run(made, running, version_compatible):
        how = ("a version-compatible engine runs on the same or a later TensorRT of its major version"
               if version_compatible else "an engine runs only on the TensorRT version that built it")
        reasons.append(f"built with TensorRT {made}, this is TensorRT {running} ({how})")
    made_cc, running_cc = built.get("compute_capability"), here.get("compute_capability")
    if running_cc is None:
        reasons.append("no CUDA GPU visible here")
    elif made_cc is None:
        reasons.append("the manifest does not record the GPU the engines were built on")
    elif not gpu_can_run(built, here, hardware_compat):
        how = {"ampere-plus": "ampere-plus engines run on compute capability 8.0 and later",
               "same-compute-capability": "these engines run on GPUs of the compute capability that built them",
               "none": "an engine runs on the GPU model that built it unless built with --hardware-compat "
                       "same-compute-capability or ampere-plus"}[hardware_compat]
        reasons.append(f"built on {built.get('gpu')} (compute capability {made_cc}), this is {here.get('gpu')} "
                       f"(compute capability {running_cc}; {how})")
    if built.get("platform") and here.get("platform") and built["platform"] != here["platform"]:
        reasons.append(f"built on {built['platform']}, this is {here['platform']} (engines are not portable "
                       "across platforms)")
    return reasons


# --- the manifest's engines --------------------------------------------------------------------------------------

def _engine_entries(manifest: dict[str, Any], directory: Path) -> list[dict[str, Any]]:
    engines = manifest.get("engines") or []
    if not isinstance(engines, list):
        raise InputError(f"{directory / MANIFEST}: 'engines' is not a list; rebuild with `trtc rebuild {directory}`")
    for index, entry in enumerate(engines):
        if not isinstance(entry, dict) or not all(k in entry for k in ("bucket", "file", "sha256")) \
                or not isinstance(entry["bucket"], int) or not isinstance(entry["sha256"], str):
            raise InputError(f"{directory / MANIFEST}: engines[{index}] lacks bucket, file or sha256; rebuild "
                             f"with `trtc rebuild {directory}`")
        inside(directory, entry["file"], "engine")
        layers = entry.get("layers")
        if isinstance(layers, dict) and layers.get("file"):
            inside(directory, layers["file"], "layer file")
    return engines


def _onnx_entry(manifest: dict[str, Any], precision: str, directory: Path) -> dict[str, Any]:
    entries = manifest.get("onnx") or {}
    if not isinstance(entries, dict):
        raise InputError(f"{directory / MANIFEST}: 'onnx' is not an object; rebuild the directory with `trtc build`")
    entry = entries.get(precision)
    if not isinstance(entry, dict) or "file" not in entry or "sha256" not in entry:
        have = ", ".join(sorted(entries)) or "none"
        raise InputError(f"{directory} has no {precision} ONNX (it has: {have}); run `trtc build` with "
                         f"--precision {precision}, or rebuild another precision")
    return entry


def _verify_onnx(directory: Path, entry: dict[str, Any]) -> None:
    """Refuse to build from an ONNX outside the directory or whose files no longer match the recorded digest."""
    verified_onnx(directory, entry)


def _stale_in(directory: Path, manifest: dict[str, Any], here: dict[str, Any]) -> list[Staleness]:
    engines = _engine_entries(manifest, directory)
    build = manifest.get("build") or {}
    if not engines:
        reason = "engines never built (built with --engine none)" if build.get("engine") == "none" else NEVER_BUILT
        return [Staleness(None, None, reason)]
    if not isinstance(build, dict) or not isinstance(manifest.get("environment") or {}, dict):
        raise InputError(f"{directory / MANIFEST}: 'build' or 'environment' is not an object; rebuild with "
                         f"`trtc rebuild {directory}`")
    shared = _environment_reasons(manifest.get("environment") or {}, here, build)
    digests: dict[str, str | None] = {}
    onnx_digests = {e.get("file"): e.get("sha256") for e in (manifest.get("onnx") or {}).values()
                    if isinstance(e, dict)}
    stale = []
    for entry in engines:
        path = inside(directory, entry["file"], "engine")
        if entry["file"] not in digests:
            digests[entry["file"]] = sha256_file(path) if path.is_file() else None
        reasons = []
        if digests[entry["file"]] is None:
            reasons.append("engine file missing")
        elif digests[entry["file"]] != entry["sha256"]:
            reasons.append("engine file differs from the manifest's sha256 (changed or truncated)")
        if entry.get("onnx") and entry.get("onnx_sha256") and onnx_digests.get(entry["onnx"]) != entry["onnx_sha256"]:
            reasons.append(f"built from another version of {entry['onnx']}")
        reasons += shared
        if reasons:
            stale.append(Staleness(entry["bucket"], entry["file"], "; ".join(reasons)))
    return stale


def stale_engines(directory: Path, env: dict[str, Any] | None = None) -> list[Staleness]:
    """The engines of ``directory`` that cannot run in ``env`` (this machine's ``environment()`` when None).

    Empty when every engine can run. A directory whose manifest lists no engines is one
    ``Staleness(None, None, "engines never built (...)")``. Raises ``InputError`` for a missing or
    malformed manifest.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    return _stale_in(directory, manifest, env if env is not None else environment())


def check_directory(directory: Path, env: dict[str, Any] | None = None) -> CheckResult:
    """``trtc check DIR``: which engines can run here (``env`` or this machine) and why the others cannot.

    ``result.exit_code`` is 0 when all can run, 1 when some are stale; a bad directory raises a
    ``TrtcError`` (exit code 2).
    """
    directory = Path(directory)
    here = env if env is not None else environment()
    manifest = read_manifest(directory)
    stale = _stale_in(directory, manifest, here)
    stale_files = {(s.bucket, s.file) for s in stale}
    fresh = [e for e in _engine_entries(manifest, directory) if (e["bucket"], e["file"]) not in stale_files]
    return CheckResult(directory, here, fresh, stale)


# --- rebuild -----------------------------------------------------------------------------------------------------

def _recorded_settings(manifest: dict[str, Any]) -> BuildSettings:
    if manifest.get("build"):
        return settings_from_dict(manifest["build"])
    # exported but never built: the export's buckets, default build settings
    return BuildSettings(buckets=tuple(manifest.get("buckets") or BuildSettings().buckets),
                         precision=manifest.get("precision", "fp32"))


def _engine_files(entries: list[dict[str, Any]]) -> set[str]:
    files = set()
    for entry in entries:
        files.add(entry["file"])
        layers = entry.get("layers")
        if isinstance(layers, dict) and layers.get("file"):
            files.add(layers["file"])
    return files


def rebuild_directory(directory: Path, if_stale: bool, settings_override: BuildSettings | None = None,
                      build_step: BuildStep | None = None, *, env: dict[str, Any] | None = None) -> RebuildResult:
    """``trtc rebuild DIR``: build the engines again from the directory's own ONNX, with its recorded settings.

    With ``if_stale``, nothing happens when every engine can run here. Otherwise the ONNX files are
    checked against their recorded sha256 (refused if changed), engines are built into a staging
    folder, and engines, layer files, timing cache and manifest (last) are moved into place; engine
    files of buckets no longer built are removed afterwards. The directory lock is held throughout.
    A failure anywhere leaves the previous engines and manifest as they were. ``settings_override``
    replaces the recorded settings (e.g. new buckets); ``build_step`` and ``env`` as for
    ``build_engine_files`` (``env``: this machine when None). Without TensorRT and no ``build_step``
    it raises ``TensorRTNotInstalled``.
    """
    directory = Path(directory)
    with directory_lock(directory, "trtc rebuild"):
        manifest = read_manifest(directory)
        here = env if env is not None else environment()
        stale = _stale_in(directory, manifest, here)
        old_entries = _engine_entries(manifest, directory)
        if if_stale and not stale:
            log.info("all %d engine(s) of %s can run here; nothing rebuilt", len(old_entries), directory)
            return RebuildResult(directory, False, [], old_entries)
        settings = settings_override or _recorded_settings(manifest)
        if settings.engine == "none":
            settings = replace(settings, engine="tensorrt")
        onnx = _onnx_entry(manifest, settings.precision, directory)
        _verify_onnx(directory, onnx)
        spec = spec_from_manifest(manifest)
        with staging_dir(directory) as stage:
            entries = build_engine_files(directory, stage, onnx["file"], spec, settings, build_step, env=here)
            rebuilt = {**manifest, **manifest_engine_keys(settings, here, entries), "engines_built": now()}
            if entries:
                rebuilt.pop("engines_note", None)  # "not built: ..." no longer describes the directory
            write_manifest(stage / MANIFEST, rebuilt)
            commit_staged(stage, directory)
        for name in sorted(_engine_files(old_entries) - _engine_files(entries)):
            inside(directory, name).unlink(missing_ok=True)
        log.info("rebuilt %d engine(s) in %s", len(entries), directory)
        return RebuildResult(directory, True, stale, entries)


# --- merge -------------------------------------------------------------------------------------------------------

def merge_manifests(directory: Path, others: list[Path]) -> dict[str, Any]:
    """Add the engines of ``others`` (one bucket each, say, built by parallel CI jobs) to ``directory``.

    Every directory must hold the same ONNX (sha256 of the built precision), the same engine-relevant
    build settings and the same TensorRT version and GPU compute capability; anything else is
    refused. Engine files are checked against their manifests before they are copied. A bucket
    already present is kept (the first directory wins). Multi-profile engines are not merged. The
    timing caches are not merged (combining them needs TensorRT). Returns the new manifest.
    """
    directory = Path(directory)
    with directory_lock(directory, "trtc merge"):
        base = read_manifest(directory)
        sources = [(directory, base)] + [(Path(o), read_manifest(Path(o))) for o in others]
        with_engines = [(d, m) for d, m in sources if _engine_entries(m, d)]
        if not with_engines:
            raise InputError("none of the directories has engines to merge; build them first")
        ref_dir, ref = with_engines[0]
        build = ref.get("build") or {}
        precision = build.get("precision", "fp32")
        onnx_sha = _onnx_entry(base, precision, directory)["sha256"]
        if build.get("multi_profile"):
            raise InputError(f"{ref_dir} holds a multi-profile engine (every bucket in one file): nothing to merge")
        merged: dict[int, dict[str, Any]] = {}
        copies: list[tuple[Path, str]] = []
        for source_dir, manifest in sources:
            entries = _engine_entries(manifest, source_dir)
            if not entries:
                continue
            if _onnx_entry(manifest, precision, source_dir)["sha256"] != onnx_sha:
                raise InputError(f"{source_dir} was built from another {precision} ONNX than {directory}: merge only "
                                 "directories built from the same export")
            other_build = manifest.get("build") or {}
            differ = [k for k in _ENGINE_SETTINGS if other_build.get(k) != build.get(k)]
            if differ:
                raise InputError(f"{source_dir} was built with other settings than {ref_dir} ({', '.join(differ)}); "
                                 "merge only engines built with the same settings")
            env, ref_env = manifest.get("environment") or {}, ref.get("environment") or {}
            keys = ["tensorrt", "compute_capability", "platform"]
            if hardware_compat_level(build.get("hardware_compat")) == "none":
                keys.append("gpu")  # such engines run on the GPU model that built them
            if any(env.get(k) != ref_env.get(k) for k in keys):
                raise InputError(f"{source_dir} was built with TensorRT {env.get('tensorrt')} on {env.get('gpu')} "
                                 f"(compute capability {env.get('compute_capability')}), {ref_dir} with "
                                 f"{ref_env.get('tensorrt')} on {ref_env.get('gpu')} (compute capability "
                                 f"{ref_env.get('compute_capability')}): one directory holds engines of one "
                                 "environment")
            for entry in entries:
                if entry["bucket"] in merged:
                    log.info("bucket %s: keeping the engine met first, skipping the one of %s", entry["bucket"],
                             source_dir)
                    continue
                path = inside(source_dir, entry["file"], "engine")
                if not path.is_file() or sha256_file(path) != entry["sha256"]:
                    raise InputError(f"{path} is missing or differs from its manifest; rebuild it before merging")
                merged[entry["bucket"]] = entry
                if source_dir != directory:
                    copies += [(inside(source_dir, name), name) for name in sorted(_engine_files([entry]))]
        with staging_dir(directory) as stage:
            for source, name in copies:
                if not source.is_file():
                    raise InputError(f"{source} is missing; rebuild its directory before merging")
                (stage / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, stage / name)
            engines = [merged[b] for b in sorted(merged)]
            new = {**base, "build": {**build, "buckets": sorted(merged)}, "environment": ref.get("environment"),
                   "engines": engines, "merged_from": [str(Path(o)) for o in others]}
            write_manifest(stage / MANIFEST, new)
            commit_staged(stage, directory)
        return new
