"""ONNX Runtime providers for trtc's onnxruntime rows and runners: CUDA by default, TensorRT's only when asked.

ONNX Runtime's TensorRT provider builds TensorRT engines inside ONNX Runtime, so a row that used it by default
would measure TensorRT under the onnxruntime label. The machine here has neither CUDA nor TensorRT: what
ONNX Runtime and torch report is replaced by a machine that has both, and only that.
"""

from __future__ import annotations

import logging

import pytest

from compiler.core import capabilities

ALL = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: list(ALL))
    monkeypatch.setattr(capabilities, "cuda_available", lambda: True)
    monkeypatch.setattr("compiler.core.capabilities.tensorrt_version", lambda: "10.13.0.35")
    return monkeypatch


def test_the_default_is_the_cuda_provider_even_where_tensorrt_imports(gpu_machine: pytest.MonkeyPatch) -> None:
    assert capabilities.ort_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_the_tensorrt_provider_only_when_asked(gpu_machine: pytest.MonkeyPatch) -> None:
    assert capabilities.ort_providers(list(ALL)) == ALL


def test_onnx_runtime_before_1_27_cannot_drive_tensorrt_11(gpu_machine: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    import onnxruntime

    gpu_machine.setattr("compiler.core.capabilities.tensorrt_version", lambda: "11.0.0.5")
    gpu_machine.setattr(onnxruntime, "__version__", "1.23.2")
    with caplog.at_level(logging.WARNING):
        assert capabilities.ort_providers(list(ALL)) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert "ONNX Runtime 1.23.2 cannot drive TensorRT 11.0.0.5" in caplog.text
    gpu_machine.setattr(onnxruntime, "__version__", "1.27.0")
    assert capabilities.ort_providers(list(ALL)) == ALL


def test_without_tensorrt_the_tensorrt_provider_is_left_out_even_when_asked(gpu_machine: pytest.MonkeyPatch) -> None:
    gpu_machine.setattr("compiler.core.capabilities.tensorrt_version", lambda: None)
    assert capabilities.ort_providers(list(ALL)) == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_warming_the_checking_providers_returns_them_and_a_failure_beside_is_only_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``warm_checking_providers`` returns the providers trtc's own runs use here (the CPU's on this machine, where
    its one-node CUDA run is not made); the thread ``warm_checking_providers_beside`` starts ends by itself, and
    when warming raises, the error is logged at debug level and nothing is raised in the caller."""
    from compiler.core import onnx_io

    assert onnx_io.warm_checking_providers() == capabilities.checking_providers()
    thread = onnx_io.warm_checking_providers_beside()
    thread.join(timeout=60)
    assert not thread.is_alive()

    def broken() -> list[str]:
        raise RuntimeError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(onnx_io, "warm_checking_providers", broken)
    with caplog.at_level(logging.DEBUG, logger="compiler.core.onnx_io"):
        thread = onnx_io.warm_checking_providers_beside()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert "warming ONNX Runtime's providers failed: libcudnn.so.9" in caplog.text
