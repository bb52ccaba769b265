"""``trtc check`` and ``trtc rebuild``: can a directory's engines run here, and rebuilding the ones that cannot.

The rules for when an engine can run are in ``compiler.backends.tensorrt.compat``.

A rebuild uses only what the directory holds: the ONNX files (checked against their recorded
sha256) and the recorded build settings. Nothing is re-exported or recalibrated, so quantization
scales stay exactly as they were.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from compiler.backends.tensorrt.build import BuildStep, build_engine_files
from compiler.backends.tensorrt.compat import (
    NEVER_BUILT,
    Staleness,
    gpu_can_run,
    stale_engines,
    stale_in,
    tensorrt_can_run,
)
from compiler.backends.tensorrt.environment import environment
from compiler.core.errors import InputError
from compiler.core.files import directory_transaction, inside, sha256_file
from compiler.core.manifest import MANIFEST, EngineRecord, Manifest, read_manifest, verified_onnx, write_manifest
from compiler.core.settings import MIN_COMPUTE_CAPABILITY, BuildSettings

__all__ = ["Staleness", "CheckResult", "RebuildResult", "stale_engines", "check_directory", "rebuild_directory",
           "merge_manifests", "precision_unsupported", "tensorrt_can_run", "gpu_can_run", "NEVER_BUILT"]

log = logging.getLogger(__name__)

# build settings that change what an engine is; engines merged into one directory must agree on them
_ENGINE_SETTINGS = ("precision", "multi_profile", "workspace_mib", "opt_level", "hardware_compat",
                    "version_compatible", "tf32")


@dataclass(frozen=True)
class CheckResult:
    """What ``trtc check DIR`` found: exit code 0 when every engine can run here, 1 when some cannot."""

    directory: Path
    environment: dict[str, Any]
    fresh: list[EngineRecord] = field(default_factory=list)  # the engines that can run here
    stale: list[Staleness] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.stale else 0

    def lines(self) -> list[str]:
        """One line per engine, for the CLI to print."""
        lines = [f"ok     bucket {e.bucket} ({e.file})" for e in self.fresh]
        lines += [f"stale  {s}" for s in self.stale]
        if self.stale:
            lines.append(f"rebuild with `trtc rebuild {self.directory} --if-stale`")
        return lines


@dataclass(frozen=True)
class RebuildResult:
    directory: Path
    rebuilt: bool
    stale_before: list[Staleness]
    engines: list[EngineRecord]


def check_directory(directory: Path, env: dict[str, Any] | None = None) -> CheckResult:
    """``trtc check DIR``: which engines can run here (``env`` or this machine) and why the others cannot.

    ``result.exit_code`` is 0 when all can run, 1 when some are stale; a bad directory raises a
    ``TrtcError`` (exit code 2).
    """
    directory = Path(directory)
    here = env if env is not None else environment()
    manifest = read_manifest(directory)
    stale = stale_in(directory, manifest, here)
    stale_files = {(s.bucket, s.file) for s in stale}
    fresh = [e for e in manifest.engines if (e.bucket, e.file) not in stale_files]
    unsupported = precision_unsupported(manifest, here)
    if unsupported and fresh:  # engines that load here but whose kernels this GPU does not have
        stale += [Staleness(e.bucket, e.file, unsupported) for e in fresh]
        fresh = []
    return CheckResult(directory, here, fresh, stale)


def precision_unsupported(manifest: Manifest, here: Mapping[str, Any]) -> str | None:
    """Why the GPU of ``here`` cannot run the engines of the build's precision (FP8 below compute capability 8.9),
    in one line; None when it can or the capability is unknown."""
    from compiler.backends.tensorrt.environment import parse_compute_capability

    precision = manifest.build.precision if manifest.build is not None else manifest.precision
    need = MIN_COMPUTE_CAPABILITY.get(precision)
    capability = parse_compute_capability(here.get("compute_capability"))
    if need is None or capability is None or capability >= need[0]:
        return None
    return (f"{precision.upper()} engines need compute capability {need[0][0]}.{need[0][1]}+ ({need[1]}); this GPU, "
            f"{here.get('gpu')}, is {here.get('compute_capability')}: rebuild the directory as --int8 or --fp16 "
            "for it")


# --- rebuild -----------------------------------------------------------------------------------------------------

def _engine_files(engines: Sequence[EngineRecord]) -> set[str]:
    return {name for engine in engines for name in engine.names}


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
    with directory_transaction(directory, "trtc rebuild") as transaction:
        manifest = read_manifest(directory)
        here = env if env is not None else environment()
        stale = stale_in(directory, manifest, here)
        old_entries = list(manifest.engines)
        if if_stale and not stale:
            log.info("all %d engine(s) of %s can run here; nothing rebuilt", len(old_entries), directory)
            return RebuildResult(directory, False, [], old_entries)
        settings = settings_override or manifest.rebuild_settings()
        if settings.engine == "none":
            settings = replace(settings, engine="tensorrt")
        from compiler.pipeline.build import refuse_unsupported_precision

        refuse_unsupported_precision(settings.precision, here)
        onnx = manifest.onnx_record(directory, settings.precision)
        verified_onnx(directory, onnx)  # refuse an ONNX outside the directory or changed since it was recorded
        stage = transaction.stage
        entries = build_engine_files(directory, stage, onnx.file, manifest.spec, settings, build_step, env=here)
        write_manifest(stage / MANIFEST, manifest.rebuilt(settings, here, entries))
        transaction.remove_after_commit(inside(directory, name)
                                        for name in sorted(_engine_files(old_entries) - _engine_files(entries)))
        log.info("rebuilt %d engine(s) in %s", len(entries), directory)
        return RebuildResult(directory, True, stale, entries)


# --- merge -------------------------------------------------------------------------------------------------------

def merge_manifests(directory: Path, others: list[Path]) -> Manifest:
    """Add the engines of ``others`` (one bucket each, say, built by parallel CI jobs) to ``directory``.

    Every directory must hold the same ONNX (sha256 of the built precision), the same engine-relevant
    build settings and the same TensorRT version and GPU compute capability; anything else is
    refused. Engine files are checked against their manifests before they are copied. A bucket
    already present is kept (the first directory wins). Multi-profile engines are not merged. The
    timing caches are not merged (combining them needs TensorRT). Returns the new manifest.
    """
    directory = Path(directory)
    with directory_transaction(directory, "trtc merge") as transaction:
        base = read_manifest(directory)
        sources = [(directory, base)] + [(Path(o), read_manifest(Path(o))) for o in others]
        with_engines = [(d, m) for d, m in sources if m.engines]
        if not with_engines:
            raise InputError("none of the directories has engines to merge; build them first")
        ref_dir, ref = with_engines[0]
        build = ref.build or BuildSettings()
        onnx_sha = base.onnx_record(directory, build.precision).sha256
        if build.multi_profile:
            raise InputError(f"{ref_dir} holds a multi-profile engine (every bucket in one file): nothing to merge")
        merged: dict[int, EngineRecord] = {}
        copies: list[tuple[Path, str]] = []
        for source_dir, manifest in sources:
            if not manifest.engines:
                continue
            if manifest.onnx_record(source_dir, build.precision).sha256 != onnx_sha:
                raise InputError(f"{source_dir} was built from another {build.precision} ONNX than {directory}: merge "
                                 "only directories built from the same export")
            other_build = manifest.build or BuildSettings()
            differ = [k for k in _ENGINE_SETTINGS if getattr(other_build, k) != getattr(build, k)]
            if differ:
                raise InputError(f"{source_dir} was built with other settings than {ref_dir} ({', '.join(differ)}); "
                                 "merge only engines built with the same settings")
            env, ref_env = manifest.environment or {}, ref.environment or {}
            keys = ["tensorrt", "compute_capability", "platform"]
            if build.hardware_compat == "none":
                keys.append("gpu")  # such engines run on the GPU model that built them
            if any(env.get(k) != ref_env.get(k) for k in keys):
                raise InputError(f"{source_dir} was built with TensorRT {env.get('tensorrt')} on {env.get('gpu')} "
                                 f"(compute capability {env.get('compute_capability')}), {ref_dir} with "
                                 f"{ref_env.get('tensorrt')} on {ref_env.get('gpu')} (compute capability "
                                 f"{ref_env.get('compute_capability')}): one directory holds engines of one "
                                 "environment")
            for entry in manifest.engines:
                if entry.bucket in merged:
                    log.info("bucket %s: keeping the engine met first, skipping the one of %s", entry.bucket,
                             source_dir)
                    continue
                path = inside(source_dir, entry.file, "engine")
                if not path.is_file() or sha256_file(path) != entry.sha256:
                    raise InputError(f"{path} is missing or differs from its manifest; rebuild it before merging")
                merged[entry.bucket] = entry
                if source_dir != directory:
                    copies += [(inside(source_dir, name), name) for name in sorted(_engine_files([entry]))]
        stage = transaction.stage
        for source, name in copies:
            if not source.is_file():
                raise InputError(f"{source} is missing; rebuild its directory before merging")
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, stage / name)
        new = base.merged(ref, list(merged.values()), [str(Path(o)) for o in others])
        write_manifest(stage / MANIFEST, new)
    return new
