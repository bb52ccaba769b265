"""The export check's tolerance: FP32 kernel noise passes on real architectures, a wrong operator does not."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from compiler.backends.onnxrt_runner import OnnxRuntimeRunner
from compiler.backends.pytorch import TorchRunner
from compiler.core.errors import InputError, VerificationError
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.frontend.export import onnx_from_torch
from compiler.frontend.loading import LoadedModel
from compiler.frontend.verify import Tolerance, compare_outputs, verify_runners
from tests.onnx_helpers import make_model, tensor

SPEC = ModelSpec((parse_input_spec("x:Bx4x100"),))


class _Noisy:
    """A reference runner: ``x * scale`` plus a fixed elementwise error, as a different kernel would give.

    With standard normal inputs the output's scale is about 0.12, as a detection head's is.
    """

    name = "noisy reference"

    def __init__(self, error: float, scale: float = 0.03) -> None:
        self.error, self.scale = error, scale
        self.input_names, self.output_names = ["x"], ["y"]

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        y = feed["x"].astype(np.float64) * self.scale
        signs = np.where(np.arange(y.size).reshape(y.shape) % 2 == 0, 1.0, -1.0)
        return {"y": (y + signs * self.error).astype(np.float32)}

    def close(self) -> None:
        pass


def _scaled_model(scale: float = 0.03) -> onnx.ModelProto:
    return make_model([onnx.helper.make_node("Mul", ["x", "k"], ["y"])], [tensor("x", ["B", 4, 100])],
                      [tensor("y", ["B", 4, 100])], {"k": np.array(scale, np.float32)})


def test_detection_head_noise_passes_where_a_scale_relative_rule_failed() -> None:
    """3.8e-5 absolute error on an output of scale ~0.1 (a detection head's) is 3e-4 of the scale, yet kernel
    noise: it passes, while 3e-3 fails."""
    with OnnxRuntimeRunner(_scaled_model(), ["CPUExecutionProvider"]) as candidate:
        results = verify_runners(candidate, _Noisy(3.8e-5), SPEC, [1, 8], None, "export check")
        assert all(r.mismatched == 0 for r in results)
        assert results[-1].max_rel > 1e-4  # the old rule's limit: it raised here
        with pytest.raises(VerificationError, match=r"batch 1, output 'y': 400 of 400 elements outside atol 0.0001"):
            verify_runners(candidate, _Noisy(3e-3), SPEC, [1, 8], None, "export check")


def test_relative_part_scales_with_each_element() -> None:
    ref = {"y": np.array([1000.0, 10.0, 0.0], np.float32)}
    close = compare_outputs({"y": np.array([1000.5, 10.005, 5e-5], np.float32)}, ref, 1)
    assert close.passes(Tolerance()) and close.mismatched == 0
    far = compare_outputs({"y": np.array([1000.0, 10.5, 0.0], np.float32)}, ref, 1)
    assert not far.passes(Tolerance()) and far.mismatched == 1 and far.worst_output == "y"
    assert compare_outputs({"y": np.array([1000.0, 10.5, 0.0], np.float32)}, ref, 1,
                           Tolerance(atol=1e-4, rtol=0.1)).passes(Tolerance(atol=1e-4, rtol=0.1))


def test_degenerate_outputs(caplog: pytest.LogCaptureFixture) -> None:
    zeros = {"y": np.zeros(6, np.float32)}
    with caplog.at_level(logging.WARNING, logger="compiler.frontend.verify"):
        assert compare_outputs({"y": np.full(6, 1e-9, np.float32)}, zeros, 2).passes(Tolerance())
    assert "all zeros in the reference" in caplog.text
    assert not compare_outputs(zeros, {"y": np.linspace(1, 2, 6, dtype=np.float32)}, 2).passes(Tolerance())
    assert not compare_outputs({"y": np.array([np.nan, 1], np.float32)}, {"y": np.ones(2, np.float32)},
                               1).passes(Tolerance())
    ids = {"k": np.array([3, 1, 2], np.int64)}
    assert compare_outputs({"k": np.array([3, 2, 1], np.int64)}, ids, 1).mismatched == 2
    with pytest.raises(InputError, match="--atol"):
        Tolerance(atol=0, rtol=0)


# --- real architectures ------------------------------------------------------------------------------------------

ARCHITECTURES: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
    # name: (inputs, dims, wrong operators to try)
    "yolo": (["images:Bx3x320x320:float32"], {}, ["add->sub", "sigmoid->hardsigmoid"]),
    "vit": (["images:Bx3x64x64:float32"], {}, ["add->sub", "softmax-axis"]),
    "bert": (["input_ids:BxS:int64[1,1000)", "attention_mask:BxS:int64", "token_type_ids:BxS:int64[0,2)"],
             {"S": "4:16:32"}, ["add->sub", "softmax-axis"]),
    "gpt": (["input_ids:BxS:int64[1,1000)"], {"S": "4:16:32"}, ["add->sub", "softmax-axis"]),
}


def _wrong(model: onnx.ModelProto, kind: str) -> onnx.ModelProto:
    """The model with one operator swapped for a plausible wrong one."""
    wrong = copy.deepcopy(model)
    nodes = list(wrong.graph.node)
    if kind == "add->sub":  # the last Add: a residual or bias near the output
        [n for n in nodes if n.op_type == "Add"][-1].op_type = "Sub"
    elif kind == "sigmoid->hardsigmoid":  # a cheap activation in place of the real one
        [n for n in nodes if n.op_type == "Sigmoid"][-1].op_type = "HardSigmoid"
    elif kind == "softmax-axis":  # attention normalised over the wrong axis
        node = next(n for n in nodes if n.op_type == "Softmax")
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("axis", 1))
    return wrong


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache: dict[str, Any] = {}

    def export(name: str) -> tuple[onnx.ModelProto, TorchRunner, ModelSpec]:
        if name not in cache:
            pytest.importorskip("transformers")
            from tests import zoo_models

            inputs, dims, _ = ARCHITECTURES[name]
            spec = ModelSpec(tuple(parse_input_spec(i) for i in inputs),
                             dict(parse_dim_range(f"{k}={v}") for k, v in dims.items()))
            loaded = LoadedModel("factory", None, module=getattr(zoo_models, name)())
            work = Path(tmp_path_factory.mktemp(name))
            model = onnx_from_torch(loaded, spec, 8, workdir=work).model
            reference = TorchRunner(loaded.module, spec.input_names, [o.name for o in model.graph.output])
            reference.activate()
            cache[name] = (model, reference, spec)
        return cache[name]  # type: ignore[no-any-return]

    return {"export": export}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_fp32_noise_passes_and_a_wrong_operator_is_caught(name: str, exported: dict[str, Any]) -> None:
    model, reference, spec = exported["export"](name)
    with OnnxRuntimeRunner(model, ["CPUExecutionProvider"]) as candidate:
        results = verify_runners(candidate, reference, spec, [1, 8], None, "export check")
    assert all(r.mismatched == 0 and r.cosine > 0.99999 for r in results), results
    for kind in ARCHITECTURES[name][2]:
        with OnnxRuntimeRunner(_wrong(model, kind), ["CPUExecutionProvider"]) as candidate, \
                pytest.raises(VerificationError, match="elements outside atol"):
            verify_runners(candidate, reference, spec, [1, 8], None, f"export check with {kind}")


# --- where the checks run ------------------------------------------------------------------------------------------

def test_checks_run_on_the_gpu_with_tf32_off_where_the_cuda_provider_is_usable() -> None:
    from compiler.frontend.verify import checking_devices

    gpu = checking_devices(["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert gpu.torch_device == "cuda" and gpu.ort_provider == "CUDAExecutionProvider"
    assert gpu.ort_providers[0][1]["use_tf32"] == "0" and gpu.ort_providers[1] == "CPUExecutionProvider"
    cpu = checking_devices(["CPUExecutionProvider"])
    assert (cpu.torch_device, cpu.ort_providers) == ("cpu", ("CPUExecutionProvider",))
    assert checking_devices().torch_device == "cpu"  # this machine has no GPU


def test_fp32_math_turns_tf32_off_and_restores_it() -> None:
    import torch

    from compiler.frontend.verify import fp32_math

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32)
    try:
        cudnn.allow_tf32 = matmul.allow_tf32 = True
        with fp32_math():
            assert (cudnn.allow_tf32, matmul.allow_tf32) == (False, False)
        assert (cudnn.allow_tf32, matmul.allow_tf32) == (True, True)
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved


def _placed_module(*, fails_off_cpu: bool = False, off: float = 1.01, off_on_cpu: float = 1.0) -> Any:
    """x * 2 that records where it was moved. Off the CPU it fails (``fails_off_cpu``: as a graph with the CPU
    baked in fails on CUDA; then a move to "meta", the stand-in for CUDA here, is only recorded so that its
    weights survive) or is ``off`` times off (a device kernel that misses the FP32 tolerance); on the CPU it is
    ``off_on_cpu`` times off."""
    import torch

    class Placed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((100,), 2.0))
            self.placed = "cpu"

        def to(self, device: Any, *args: Any, **kwargs: Any) -> Any:
            self.placed = str(device)
            return self if fails_off_cpu and self.placed == "meta" else super().to(device, *args, **kwargs)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if fails_off_cpu and self.placed != "cpu":
                raise RuntimeError(f"Expected all tensors to be on the same device, but found {x.device} and cpu")
            return x * self.scale * (off if self.placed != "cpu" else off_on_cpu)

    return Placed()


def test_eager_reference_falls_back_to_the_cpu_and_ends_there(caplog: pytest.LogCaptureFixture) -> None:
    from compiler.frontend.verify import EagerReference

    module = _placed_module(fails_off_cpu=True)
    eager = EagerReference(module, ["x"], ["y"], device="meta")
    eager.activate()
    assert module.placed == "meta"
    feed = SPEC.example_feed(2)
    with caplog.at_level(logging.WARNING):
        got = eager.infer(feed)
    assert eager.device == "cpu" and "cannot run the model on meta" in caplog.text
    np.testing.assert_array_equal(got["y"], feed["x"] * 2.0)
    module.placed = "meta"
    eager.close()
    assert module.placed == "cpu"


def _times_two() -> onnx.ModelProto:
    return make_model([onnx.helper.make_node("Mul", ["x", "scale"], ["y"])], [tensor("x", ["B", 4, 100])],
                      [tensor("y", ["B", 4, 100])], {"scale": np.full(100, 2.0, np.float32)})


def test_a_failed_gpu_check_is_judged_on_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    from compiler.frontend.verify import CheckingDevices, ExportChecks

    gpu = CheckingDevices("cpu:0", ("CPUExecutionProvider",))  # "cpu:0" stands in for CUDA on this machine
    checks = ExportChecks(_placed_module(), ["x"], ["y"], devices=gpu)
    with caplog.at_level(logging.WARNING):
        results = checks.run(_times_two(), None, SPEC, [1, 3], None, "export check")
    assert "export check failed on the GPU" in caplog.text and "checking again on the CPU" in caplog.text
    assert [r.batch for r in results] == [1, 3] and all(r.mismatched == 0 for r in results)
    assert checks.record() == {"onnxruntime": "CPUExecutionProvider", "torch": "cpu", "tf32": False}
    checks.run(_times_two(), None, SPEC, [2], None, "pass check")  # later checks stay on the CPU
    checks.close()

    wrong = ExportChecks(_placed_module(off_on_cpu=1.01), ["x"], ["y"], devices=gpu)  # a real error fails
    with pytest.raises(VerificationError, match=r"export check: onnxruntime.* differs from torch"):
        wrong.run(_times_two(), None, SPEC, [1], None, "export check")
    # without an eager model the original ONNX is the reference
    onnx_only = ExportChecks(None, ["x"], ["y"], devices=CheckingDevices("cpu", ("CPUExecutionProvider",)))
    assert onnx_only.run(_times_two(), _times_two(), SPEC, [2], None, "pass check")[0].max_abs == 0.0
    assert onnx_only.reference_name == "onnxruntime[original ONNX]" and onnx_only.record()["torch"] is None


@pytest.mark.gpu
@pytest.mark.ort_cuda
def test_export_checks_run_on_cuda_with_tf32_off_and_pass_fp32_noise(caplog: pytest.LogCaptureFixture,
                                                                     tmp_path: Path) -> None:
    import torch

    from compiler.frontend.verify import ExportChecks

    torch.manual_seed(0)
    # a convolution and a matmul with a long reduction (6400), where TF32 on either side would show
    module = torch.nn.Sequential(torch.nn.Conv1d(4, 64, 3, padding=1), torch.nn.GELU(), torch.nn.Flatten(),
                                 torch.nn.Linear(6400, 10)).eval()
    exported = onnx_from_torch(LoadedModel("factory", None, module=module), SPEC, 8, workdir=tmp_path)
    checks = ExportChecks(module, ["x"], [o.name for o in exported.model.graph.output])
    assert (checks.devices.torch_device, checks.devices.ort_provider) == ("cuda", "CUDAExecutionProvider")
    with caplog.at_level(logging.WARNING):
        results = checks.run(exported.model, None, SPEC, [1, 8], None, "export check")
    assert "failed on the GPU" not in caplog.text and all(r.mismatched == 0 for r in results)
    assert checks.record() == {"onnxruntime": "CUDAExecutionProvider", "torch": "cuda", "tf32": False}
    checks.close()
    assert next(module.parameters()).device.type == "cpu"


def test_sequence_string_and_empty_outputs_are_compared() -> None:
    """ONNX Runtime's outputs that are not tensors: a sequence is compared element by element (a changed element or
    length fails), strings must be equal, an empty optional (None) matches only None."""
    seq = [np.ones(3, np.float32), np.zeros(2, np.float32)]
    same = compare_outputs({"s": [a.copy() for a in seq], "t": np.array(["a", "b"]), "o": None},
                           {"s": seq, "t": np.array(["a", "b"]), "o": None}, batch=1)
    assert same.passes(Tolerance()) and same.elements == 7
    changed = compare_outputs({"s": [seq[0], seq[1] + 1]}, {"s": seq}, batch=1)
    assert not changed.passes(Tolerance()) and changed.worst_output == "s[1]"
    assert not compare_outputs({"t": np.array(["a", "c"])}, {"t": np.array(["a", "b"])}, batch=1).passes(Tolerance())
    with pytest.raises(VerificationError, match="a sequence of 2 elements in the reference, of 1 here"):
        compare_outputs({"s": seq[:1]}, {"s": seq}, batch=1)
    with pytest.raises(VerificationError, match="output o: empty"):
        compare_outputs({"o": None}, {"o": np.ones(2)}, batch=1)
