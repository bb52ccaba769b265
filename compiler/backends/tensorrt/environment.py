"""Where engines are built and run: TensorRT, CUDA, the driver, the GPU and the platform, and the GPUs visible.

The manifest records ``environment()`` at build time and ``trtc check`` compares it with this machine's
(``compiler.backends.tensorrt.compat``). GPU facts come from cuda-python, torch or nvidia-smi, whichever is
here; nothing here imports TensorRT beyond asking its version.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

from compiler.core.capabilities import tensorrt_version
from compiler.core.settings import BuildSettings

__all__ = ["parse_compute_capability", "environment", "visible_gpus"]

log = logging.getLogger(__name__)


def parse_compute_capability(text: Any) -> tuple[int, int] | None:
    """A compute capability as numbers: "8.6" -> (8, 6); None for anything else (None, "", "N/A")."""
    match = re.fullmatch(r"(\d+)\.(\d+)", str(text)) if text is not None else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def _nvidia_smi(args: list[str]) -> list[str]:
    """Lines nvidia-smi prints for ``args``; empty when it is absent or fails (no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.debug("nvidia-smi failed: %s", err)
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def _cuda_version(number: int) -> str:
    """CUDA's integer versions: 12040 -> "12.4"."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _gpu_from_cuda_python() -> dict[str, Any]:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return {}
    info: dict[str, Any] = {}
    try:
        err, version = cudart.cudaRuntimeGetVersion()
        if int(err) == 0:
            info["cuda_runtime"] = _cuda_version(version)
        err, version = cudart.cudaDriverGetVersion()
        if int(err) == 0 and version:
            info["cuda_driver"] = _cuda_version(version)
        err, props = cudart.cudaGetDeviceProperties(0)
        if int(err) == 0:
            name = props.name
            info["gpu"] = (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
            info["compute_capability"] = f"{props.major}.{props.minor}"
    except (RuntimeError, OSError) as exc:  # cuda-python installed, the CUDA runtime library not loadable
        log.debug("cuda-python cannot query the GPU: %s", exc)
    return info


def _gpu_from_torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {}
    info: dict[str, Any] = {}
    if torch.version.cuda:
        info["cuda_runtime"] = torch.version.cuda
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            info["gpu"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = f"{major}.{minor}"
    except RuntimeError as err:  # a driver that torch sees but cannot initialize
        log.debug("torch cannot query the GPU: %s", err)
    return info


def _gpu_from_nvidia_smi() -> dict[str, Any]:
    lines = _nvidia_smi(["--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"])
    if not lines:  # drivers before 510 do not know the compute_cap field
        lines = _nvidia_smi(["--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not lines:
        return {}
    parts = [p.strip() for p in lines[0].split(",")]
    info: dict[str, Any] = {"gpu": parts[0], "driver": parts[-1]}
    if len(parts) == 3 and parse_compute_capability(parts[1]):
        info["compute_capability"] = parts[1]
    header = re.search(r"CUDA Version:\s*([0-9.]+)", "\n".join(_nvidia_smi([])))
    if header:
        info["cuda_driver"] = header.group(1)
    return info


def environment(settings: BuildSettings | None = None) -> dict[str, Any]:
    """Where engines are built or run: TensorRT, CUDA, GPU, platform, and the compatibility settings.

    Keys: ``tensorrt`` (version or None when not installed), ``cuda_runtime`` (e.g. "12.9"),
    ``cuda_driver`` (the newest CUDA the driver supports), ``driver`` (driver version),
    ``gpu`` (name of device 0), ``compute_capability`` ("9.0"), ``platform`` ("linux-x86_64"),
    ``hardware_compat`` (the level) and ``version_compatible`` (from ``settings``; "none"/False without). GPU facts come
    from cuda-python when installed, then torch (a CUDA build that sees a GPU), then nvidia-smi; a
    fact no source gives is None. Never raises for a missing TensorRT, driver or GPU.
    """
    info: dict[str, Any] = {"tensorrt": tensorrt_version(), "cuda_runtime": None, "cuda_driver": None,
                            "driver": None, "gpu": None, "compute_capability": None}
    gpu_keys = ("cuda_runtime", "cuda_driver", "driver", "gpu", "compute_capability")
    for source in (_gpu_from_cuda_python, _gpu_from_torch, _gpu_from_nvidia_smi):
        if all(info[key] is not None for key in gpu_keys):
            break
        for key, value in source().items():
            if info.get(key) is None:
                info[key] = value
    info["platform"] = f"{sys.platform}-{platform.machine()}"
    info["hardware_compat"] = settings.hardware_compat if settings else "none"
    info["version_compatible"] = bool(settings.version_compatible) if settings else False
    return info


def visible_gpus() -> list[str]:
    """The CUDA device ids a worker may be pinned to: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    lines = _nvidia_smi(["--query-gpu=index", "--format=csv,noheader"])
    return [line.strip() for line in lines if line.strip()]
