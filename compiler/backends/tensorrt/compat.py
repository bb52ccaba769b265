"""When a TensorRT engine can run: the compatibility rules ``trtc check`` and the serving TensorRT backend share.

An engine runs only where three things hold (TensorRT's "Engine Compatibility" documentation):

* the same TensorRT version built it (major, minor, patch and build), unless it was built
  version-compatible: then any later runtime of the same major runs it, and a TensorRT 11 runtime
  runs a version-compatible TensorRT 10 engine (the one cross-major pair the support matrix lists);
* the GPU model that built it (an engine built for an H100 is not run on an H200 or GH200, though all
  three are compute capability 9.0: TensorRT tunes it to the device), unless built hardware-compatible:
  ``--hardware-compat same-compute-capability`` runs on any GPU of the same compute capability,
  ``--hardware-compat`` (``ampere-plus``) on any GPU of compute capability 8.0 or later;
* the file is the one the manifest records (its sha256), on the platform that built it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.backends.tensorrt.environment import environment, parse_compute_capability
from compiler.core.capabilities import version_tuple
from compiler.core.files import inside, sha256_file
from compiler.core.manifest import Manifest, read_manifest
from compiler.core.settings import hardware_compat_level

__all__ = ["Staleness", "NEVER_BUILT", "tensorrt_can_run", "later_runtimes", "gpu_can_run", "gpus_that_run",
           "environment_reasons", "stale_in", "stale_engines"]

NEVER_BUILT = "engines never built (TensorRT was not available at build time)"


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


# --- compatibility rules -----------------------------------------------------------------------------------------

def tensorrt_can_run(built: str, running: str, version_compatible: bool) -> bool:
    """Whether TensorRT ``running`` can load an engine that TensorRT ``built`` made."""
    if built == running:
        return True
    if not version_compatible:
        return False
    old, new = version_tuple(built), version_tuple(running)
    if not old or not new or new < old:
        return False
    return new[0] == old[0] or (old[0], new[0]) == (10, 11)


def later_runtimes(built: str) -> str:
    """In words, the TensorRT releases that load a version-compatible engine TensorRT ``built`` made (the rule of
    ``tensorrt_can_run``): "TensorRT 10.13.0.35 or a later 10.x or 11.x"; "TensorRT 11.4.0.106 or a later 11.x"."""
    numbers = version_tuple(built)
    if not numbers:
        return f"TensorRT {built} or a later release of its major version"
    later = f"a later {numbers[0]}.x" + (" or 11.x" if numbers[0] == 10 else "")
    return f"TensorRT {built} or {later}"


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


def gpus_that_run(built: dict[str, Any], hardware_compat: object) -> str:
    """In words, the GPUs that run an engine built on the GPU of environment ``built`` at a hardware-compatibility
    level (the rule of ``gpu_can_run``), e.g. "it runs only on the GPU model that built it, an NVIDIA H200 ..."."""
    level = hardware_compat_level(hardware_compat)
    if level == "ampere-plus":
        return "it runs on any GPU of compute capability 8.0 or later (built --hardware-compat ampere-plus)"
    capability = built.get("compute_capability") or "unknown"
    if level == "same-compute-capability":
        return (f"it runs on any GPU of compute capability {capability} (built --hardware-compat "
                "same-compute-capability)")
    return (f"it runs only on the GPU model that built it, {built.get('gpu') or 'unrecorded'} (compute capability "
            f"{capability}): rebuild with --hardware-compat same-compute-capability or ampere-plus for other GPUs")


def environment_reasons(built: dict[str, Any], here: dict[str, Any], version_compatible: bool,
                        hardware_compat: str) -> list[str]:
    """Reasons, shared by every engine of a directory built in ``built`` (its environment record) with these
    compatibility settings (``Manifest.version_compatible``, the level ``Manifest.hardware_compat``), why they
    cannot run in ``here``."""
    reasons = []
    made, running = built.get("tensorrt"), here.get("tensorrt")
    if running is None:
        reasons.append(f"TensorRT is not installed here (built with TensorRT {made})")
    elif made is None:
        reasons.append("the manifest does not record which TensorRT built the engines")
    elif not tensorrt_can_run(made, running, version_compatible):
        how = (f"a version-compatible engine runs on {later_runtimes(made)}"
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

def stale_in(directory: Path, manifest: Manifest, here: dict[str, Any]) -> list[Staleness]:
    """The engines of ``directory`` (its ``manifest``, from ``read_manifest``, which has checked that every engine and
    layer file lies inside the directory) that cannot run in ``here``."""
    if not manifest.engines:
        built_none = manifest.build is not None and manifest.build.engine == "none"
        return [Staleness(None, None, "engines never built (built with --engine none)" if built_none else NEVER_BUILT)]
    shared = environment_reasons(dict(manifest.environment or {}), here, manifest.version_compatible,
                                 manifest.hardware_compat)
    digests: dict[str, str | None] = {}
    onnx_digests = {record.file: record.sha256 for record in manifest.onnx.values()}
    stale = []
    for engine in manifest.engines:
        path = inside(directory, engine.file, "engine")
        if engine.file not in digests:
            digests[engine.file] = sha256_file(path) if path.is_file() else None
        reasons = []
        if digests[engine.file] is None:
            reasons.append("engine file missing")
        elif digests[engine.file] != engine.sha256:
            reasons.append("engine file differs from the manifest's sha256 (changed or truncated)")
        if engine.onnx and engine.onnx_sha256 and onnx_digests.get(engine.onnx) != engine.onnx_sha256:
            reasons.append(f"built from another version of {engine.onnx}")
        reasons += shared
        if reasons:
            stale.append(Staleness(engine.bucket, engine.file, "; ".join(reasons)))
    return stale


def stale_engines(directory: Path, env: dict[str, Any] | None = None) -> list[Staleness]:
    """The engines of ``directory`` that cannot run in ``env`` (this machine's ``environment()`` when None).

    Empty when every engine can run. A directory whose manifest lists no engines is one
    ``Staleness(None, None, "engines never built (...)")``. Raises ``InputError`` for a missing or
    malformed manifest.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    return stale_in(directory, manifest, env if env is not None else environment())


