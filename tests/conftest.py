"""Shared fixtures and the skips for hardware this machine may lack."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so tests can import examples.models


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from compiler.core.capabilities import tensorrt_version

    has_trt = tensorrt_version() is not None  # a namespace package or stubs named tensorrt do not count
    has_gpu = _cuda()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    skip_trt = pytest.mark.skip(
        reason="needs TensorRT and a GPU: " + ("no CUDA GPU here" if has_trt else
                                               "no real TensorRT imports here (install trtc[tensorrt] on a "
                                               "machine with an NVIDIA GPU)"))
    skip_ort_cuda = pytest.mark.skip(reason="needs ONNX Runtime's CUDA provider: the CPU build of onnxruntime is "
                                            "installed here")
    for item in items:
        # by marker, not keyword: item.keywords also holds the names of the folders above a test, and every test
        # under tests/compiler/backends/tensorrt/ would then count as needing TensorRT
        marks = {mark.name for mark in item.iter_markers()}
        if "tensorrt" in marks and not (has_trt and has_gpu):
            item.add_marker(skip_trt)
        elif "gpu" in marks and not has_gpu:
            item.add_marker(skip_gpu)
        elif "ort_cuda" in marks and not (has_gpu and _ort_cuda()):
            item.add_marker(skip_ort_cuda)


def _ort_cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


# --- engine builds without TensorRT ---------------------------------------------------------------------------

# The environment of a machine with TensorRT and an H200, as compiler.backends.tensorrt.environment.environment()
# reports one; tests of the build step's test double and of staleness pass it explicitly.
H200_ENV = {"tensorrt": "10.13.0.35", "cuda_runtime": "12.9", "cuda_driver": "12.9", "driver": "575.57.08",
            "gpu": "NVIDIA H200", "compute_capability": "9.0", "platform": "linux-x86_64"}

FAKE_ENGINE_HEADER = b"FAKE ENGINE WRITTEN BY A TEST DOUBLE - NOT A TENSORRT ENGINE\n"


def fake_engine_build_step_for_tests(loader: Any, profiles: list[Any] | None = None) -> tuple[bytes, list[str]]:
    """TEST DOUBLE OF THE BUILD STEP ONLY: no TensorRT is involved and the bytes are not an engine.

    Stands in for ``compiler.backends.tensorrt.build_step.tensorrt_build_step`` so that everything around a
    build (engine files, manifest entries, staleness, rebuild, merge, atomic commits) runs for real where
    TensorRT cannot be installed. The "engine" is derived from the ONNX file's sha256, the loader's optimization
    profiles and the GPU the worker was pinned to; the timing cache is appended to under Polygraphy's own
    file lock, as Polygraphy's ``save_timing_cache`` does after a real build (leaving ``timing.cache.lock``).
    One layer-information JSON per profile (``profiles``, else the loader's), as the real step returns.
    """
    from polygraphy import util

    from compiler.core.files import sha256_file

    network, create_config = loader._network, loader._config._config  # Polygraphy keeps its chain private
    built = [{name: [list(s.min), list(s.opt), list(s.max)] for name, s in profile.items()}
             for profile in create_config.profiles]
    record = {"onnx_sha256": sha256_file(network.path), "profiles": built,
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "tf32": create_config.tf32}
    with util.LockFile(loader.timing_cache_path), open(loader.timing_cache_path, "ab") as cache:
        cache.write(json.dumps(built).encode() + b"\n")
    layers = {"Layers": [{"Name": "fc + relu", "Outputs": [{"Name": "y", "DataType": "Float"}]}]}
    return FAKE_ENGINE_HEADER + json.dumps(record).encode(), [json.dumps(layers)] * len(profiles or built)


@pytest.fixture
def exported_dir(tmp_path: Path) -> Path:
    """A directory as ``trtc export`` leaves it, for a tiny ONNX model: x (Bx64) -> MatMul -> Relu -> y (Bx8).

    The weights (2 KiB) live in model.onnx.data, as the exporter writes them; buckets 1 and 4.
    """
    from onnx import helper

    from compiler.core.manifest import MANIFEST, FileRecord, Manifest, SourceRecord, now, write_manifest
    from compiler.core.onnx_io import save_onnx
    from tests.onnx_helpers import make_model, tensor

    out = tmp_path / "exported"
    weights = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
                        helper.make_node("Relu", ["h"], ["y"], name="relu")],
                       [tensor("x", ["B", 64])], [tensor("y", ["B", 8])], {"w": weights})
    save_onnx(model, out / "model.onnx")
    write_manifest(out / MANIFEST, Manifest(
        trtc_version="0.1.0", created=now(), source=SourceRecord("tests/conftest.py:exported_dir", "onnx", "0" * 64),
        inputs=("x:Bx64:float32",), output_names=("y",), buckets=(1, 4),
        onnx={"fp32": FileRecord.for_onnx(out, out / "model.onnx")}, precision="fp32"))
    return out
