"""What a bench run compares with, and PyTorch's flags while it runs.

The reference is the source model as the build exported it (``eager_model``), run in FP32 eager
PyTorch; without a PyTorch model (an ONNX source) it is ONNX Runtime FP32 on the CPU.
``torch_bench_mode`` sets PyTorch's TF32 flags to the run's policy and turns cuDNN autotuning on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from compiler.backends.base import Runner
from compiler.backends.registry import check_runner
from compiler.bench.target import Target
from compiler.core.errors import InputError
from compiler.core.manifest import Manifest, SourceRecord

__all__ = ["eager_model", "reference_outputs", "torch_bench_mode"]


def eager_model(manifest: Manifest, device: str = "cpu", trust_pickle: bool = False,
                directory: Path | None = None) -> tuple[Any, str]:
    """The source model as the build in ``directory`` exported it (its ``source.snapshot``), or None and the reason.

    The snapshot is the state dict a factory gave at build time, or a copy of the model file, read
    inside the directory after its sha256 matches: bench runs the weights the build exported, not a
    factory called again. An ExportedProgram is moved to the device with torch's
    ``move_to_device_pass``, since its graph names devices literally.
    """
    from compiler.frontend.loading import load_snapshot

    source = manifest.source or SourceRecord()
    fmt, text = source.format, source.path
    if fmt == "onnx":
        return None, "the build's source is an ONNX file: there is no PyTorch model to run"
    if fmt == "pickle" and not trust_pickle:
        return None, ("the source is a pickled nn.Module: pass --trust-pickle to load it (this runs code from "
                      "the file)")
    if directory is None:
        return None, "no build directory to read the source model's snapshot from"
    try:
        loaded = load_snapshot(directory, manifest, trust_pickle)
    except InputError as err:
        return None, f"the source model does not load: {err}"
    module = loaded.module
    if loaded.exported_program is not None and device != "cpu":
        from torch.export.passes import move_to_device_pass

        module = move_to_device_pass(loaded.exported_program, device).module()
    return module, f"{fmt} {text}"


def reference_outputs(target: Target, feeds: dict[int, dict[str, np.ndarray]], device: str,
                      ) -> tuple[dict[int, dict[str, np.ndarray]], str]:
    """FP32 eager PyTorch outputs per bucket; ONNX Runtime FP32 on the CPU when there is no PyTorch model."""
    runner: Runner
    if target.model is not None:
        runner = check_runner("torch", target.model, target.spec.input_names, list(target.manifest.output_names),
                              device)
        what = f"torch/fp32 (eager, {device})"
    else:
        runner = check_runner("onnxruntime", target.onnx.path("fp32"), ["CPUExecutionProvider"])
        what = "onnxruntime/fp32 (CPUExecutionProvider): no PyTorch model to compare with"
    with runner:
        return {b: runner.infer(feed) for b, feed in feeds.items()}, what


@contextlib.contextmanager
def torch_bench_mode(tf32: bool) -> Iterator[None]:
    """PyTorch's TF32 flags (matmul and cuDNN) set to the run's policy and cuDNN autotuning on, restored afterwards."""
    import torch

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark)
    cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark = tf32, tf32, True
    try:
        yield
    finally:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark = saved
