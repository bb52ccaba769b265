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

__all__ = ["parse_compute_capability", "environment", "visible_gpus", "same_gpu_model"]

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


def _gpu_from_cuda_python(device: int | None) -> dict[str, Any]:
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
        if device is None:
            err, current = cudart.cudaGetDevice()
            device = int(current) if int(err) == 0 else 0
        err, props = cudart.cudaGetDeviceProperties(device)
        if int(err) == 0:
            name = props.name
            info["gpu"] = (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
            info["compute_capability"] = f"{props.major}.{props.minor}"
    except (RuntimeError, OSError) as exc:  # cuda-python installed, the CUDA runtime library not loadable
        log.debug("cuda-python cannot query the GPU: %s", exc)
    return info


def _gpu_from_torch(device: int | None) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {}
    info: dict[str, Any] = {}
    if torch.version.cuda:
        info["cuda_runtime"] = torch.version.cuda
    try:
        if torch.cuda.is_available():
            index = torch.cuda.current_device() if device is None else device
            if index < torch.cuda.device_count():
                major, minor = torch.cuda.get_device_capability(index)
                info["gpu"] = torch.cuda.get_device_name(index)
                info["compute_capability"] = f"{major}.{minor}"
    except RuntimeError as err:  # a driver that torch sees but cannot initialize
        log.debug("torch cannot query the GPU: %s", err)
    return info


def _cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's entries (GPU indices or UUIDs), or None when it is unset. As CUDA reads it: an
    empty entry or -1 hides every GPU from there on."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    entries = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry == "-1":
            break
        entries.append(entry)
    return entries


def _nvidia_smi_id(device: int) -> str | None:
    """The ``nvidia-smi --id`` of CUDA device ``device`` of this process, or None when it has no such device.

    nvidia-smi ignores CUDA_VISIBLE_DEVICES, so the device is found through the variable's entry for it (an
    index or a UUID, both of which ``--id`` takes). Without the variable the CUDA ordinal is taken as
    nvidia-smi's index: exact with CUDA_DEVICE_ORDER=PCI_BUS_ID (nvidia-smi's order); CUDA's default order,
    fastest first, can differ on a host with GPUs of several models.
    """
    visible = _cuda_visible_devices()
    if visible is None:
        return str(device)
    return visible[device] if 0 <= device < len(visible) else None


def _gpu_from_nvidia_smi(device: int | None) -> dict[str, Any]:
    selector = _nvidia_smi_id(0 if device is None else device)
    if selector is None:
        return {}
    lines = _nvidia_smi([f"--id={selector}", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"])
    if not lines:  # drivers before 510 do not know the compute_cap field
        lines = _nvidia_smi([f"--id={selector}", "--query-gpu=name,driver_version", "--format=csv,noheader"])
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


def environment(settings: BuildSettings | None = None, device: int | None = None) -> dict[str, Any]:
    """Where engines are built or run: TensorRT, CUDA, the GPU ``device``, platform, and the compatibility settings.

    ``device``: the CUDA device (its ordinal in this process, as in ``cuda:N``) that builds or runs the engines;
    None: the current one (device 0 in a process that has not picked one, as TensorRT's builder does).
    Keys: ``tensorrt`` (version or None when not installed), ``cuda_runtime`` (e.g. "12.9"),
    ``cuda_driver`` (the newest CUDA the driver supports), ``driver`` (driver version),
    ``gpu`` (name of the device), ``compute_capability`` ("9.0"), ``platform`` ("linux-x86_64"),
    ``hardware_compat`` (the level) and ``version_compatible`` (from ``settings``; "none"/False without). GPU facts come
    from cuda-python when installed, then torch (a CUDA build that sees a GPU), then nvidia-smi (through
    CUDA_VISIBLE_DEVICES: ``_nvidia_smi_id``); a fact no source gives is None (a device this process does not
    have: its ``gpu`` and ``compute_capability``). Never raises for a missing TensorRT, driver or GPU.
    """
    info: dict[str, Any] = {"tensorrt": tensorrt_version(), "cuda_runtime": None, "cuda_driver": None,
                            "driver": None, "gpu": None, "compute_capability": None}
    gpu_keys = ("cuda_runtime", "cuda_driver", "driver", "gpu", "compute_capability")
    for source in (_gpu_from_cuda_python, _gpu_from_torch, _gpu_from_nvidia_smi):
        if all(info[key] is not None for key in gpu_keys):
            break
        for key, value in source(device).items():
            if info.get(key) is None:
                info[key] = value
    info["platform"] = f"{sys.platform}-{platform.machine()}"
    info["hardware_compat"] = settings.hardware_compat if settings else "none"
    info["version_compatible"] = bool(settings.version_compatible) if settings else False
    return info


def visible_gpus() -> list[str]:
    """The GPU ids a build worker may be pinned to (CUDA_VISIBLE_DEVICES=id): CUDA_VISIBLE_DEVICES's entries if it
    is set, else the indices nvidia-smi lists."""
    visible = _cuda_visible_devices()
    if visible is not None:
        return visible
    lines = _nvidia_smi(["--query-gpu=index", "--format=csv,noheader"])
    return [line.strip() for line in lines if line.strip()]


def same_gpu_model(built: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether two environments' GPUs are of one model (name and compute capability); True where either is unknown."""
    keys = ("gpu", "compute_capability")
    if any(built.get(k) is None or here.get(k) is None for k in keys):
        return True
    return all(built[k] == here[k] for k in keys)
