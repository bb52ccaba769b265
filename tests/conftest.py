"""Shared fixtures and the skips for hardware this machine may lack."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
    has_trt = importlib.util.find_spec("tensorrt") is not None
    has_gpu = _cuda()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    skip_trt = pytest.mark.skip(reason="needs TensorRT: `import tensorrt` fails here (install trtc[tensorrt] "
                                       "on a machine with an NVIDIA GPU)")
    for item in items:
        if "tensorrt" in item.keywords and not (has_trt and has_gpu):
            item.add_marker(skip_trt)
        elif "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
