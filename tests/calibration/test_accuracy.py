"""The accuracy gate's comparison: FP16 rounded as FP16 hardware does, whole-output cosines, degenerate references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from calibration.accuracy import Evaluator, sample_cosines
from calibration.fp16 import fp16_model_from
from calibration.fp16_policy import Fp16Policy
from calibration.fp16_rounding import fp16_rounding_emulation
from compiler.cli import cli
from compiler.core.capabilities import checking_providers
from compiler.core.onnx_io import ort_session
from compiler.core.settings import GateSettings


def _scale_chain(factors: list[float], name: str = "y") -> onnx.ModelProto:
    """FP32 y = x * f0 * f1 * ...: each product is its own node, so FP16 rounds in between."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 8])
    y = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", 8])
    nodes, inits, last = [], [], "x"
    for i, f in enumerate(factors):
        inits.append(numpy_helper.from_array(np.array(f, np.float32), f"f{i}"))
        out = name if i == len(factors) - 1 else f"h{i}"
        nodes.append(helper.make_node("Mul", [last, f"f{i}"], [out], name=f"mul{i}"))
        last = out
    model = helper.make_model(helper.make_graph(nodes, "chain", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _numpy_fp16_chain(x: np.ndarray, factors: list[float]) -> np.ndarray:
    h = x.astype(np.float16)
    with np.errstate(over="ignore"):
        for f in factors:
            h = (h.astype(np.float32) * np.float32(np.float16(f))).astype(np.float16)
    return h.astype(np.float32)


X = np.linspace(0.5, 2.0, 32, dtype=np.float32).reshape(4, 8)
UNDERFLOW = [1e-4, 1e-4, 1e4, 1e4]  # 1e-8 is below FP16's smallest subnormal (6e-8): zeros, then zeros
OVERFLOW = [300.0, 300.0, 1 / 300, 1 / 300]  # 9e4 * x exceeds 65504 for x > 0.73: inf


@pytest.mark.parametrize("factors", [UNDERFLOW, OVERFLOW], ids=["underflow", "overflow"])
def test_emulation_rounds_every_node_like_numpy_float16(factors: list[float]) -> None:
    fp16, _ = fp16_model_from(_scale_chain(factors))
    emulated = fp16_rounding_emulation(fp16)
    assert not any(t.data_type == TensorProto.FLOAT16 for t in emulated.graph.initializer)
    got = ort_session(emulated).run(None, {"x": X})[0]
    np.testing.assert_array_equal(got, _numpy_fp16_chain(X, factors))
    fp32 = ort_session(_scale_chain(factors)).run(None, {"x": X})[0]
    assert not np.allclose(got, fp32, rtol=1e-2)  # FP16 really lost the values


def test_emulation_matches_numpy_on_ordinary_values() -> None:
    factors = [1.1, 0.37, 3.3]
    got = ort_session(fp16_rounding_emulation(fp16_model_from(_scale_chain(factors))[0])).run(None, {"x": X})[0]
    np.testing.assert_array_equal(got, _numpy_fp16_chain(X, factors))


def _evaluator(model: onnx.ModelProto, batches: list[dict[str, np.ndarray]]) -> Evaluator:
    return Evaluator.from_model(model, batches, None, GateSettings(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("factors", [UNDERFLOW, OVERFLOW], ids=["underflow", "overflow"])
def test_fp16_gate_fails_a_model_that_leaves_fp16_range(factors: list[float]) -> None:
    model = _scale_chain(factors)
    evaluator = _evaluator(model, [{"x": X}])
    result = evaluator.evaluate(fp16_model_from(model)[0])  # type rules only: no range data
    assert result.fp16_emulated and not result.passed, result.summary()
    assert result.cosine_mean < 0.9


def test_fp16_gate_passes_when_the_range_pass_keeps_the_overflow_in_fp32() -> None:
    model = _scale_chain(OVERFLOW)
    max_abs = {"h0": float(np.abs(X).max() * 300), "h1": float(np.abs(X).max() * 9e4), "h2": 300.0, "y": 2.0}
    fp16, report = fp16_model_from(model, Fp16Policy(), max_abs)
    assert report.fp32_nodes
    result = _evaluator(model, [{"x": X}]).evaluate(fp16)
    assert result.passed and result.cosine_mean > 0.9999, result.summary()


def _two_outputs(broken_scores: bool) -> onnx.ModelProto:
    """boxes = x[:, :4] * 2 and scores = x[:, 4:] * 3 (or * -3: the wrong sign), YOLO-like rows of 4 + classes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 100, 6])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("boxes", "scores")]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for v, n in
             (([0], "s0"), ([4], "s4"), ([6], "s6"), ([2], "ax"))]
    inits += [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
              numpy_helper.from_array(np.array(-3.0 if broken_scores else 3.0, np.float32), "three")]
    nodes = [helper.make_node("Slice", ["x", "s0", "s4", "ax"], ["b"]),
             helper.make_node("Slice", ["x", "s4", "s6", "ax"], ["s"]),
             helper.make_node("Mul", ["b", "two"], ["boxes"]), helper.make_node("Mul", ["s", "three"], ["scores"])]
    model = helper.make_model(helper.make_graph(nodes, "det", [x], outs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_the_worst_whole_output_is_named_and_decides() -> None:
    batches = [{"x": np.random.default_rng(0).uniform(0.1, 1, (4, 100, 6)).astype(np.float32)}]
    result = _evaluator(_two_outputs(False), batches).evaluate(_two_outputs(True))
    assert not result.passed and result.worst_output == "scores"
    assert result.per_output["boxes"]["cosine_mean"] == pytest.approx(1.0)
    assert result.per_output["scores"]["cosine_mean"] == pytest.approx(-1.0)
    assert "on output scores" in result.summary()


def test_whole_output_cosine_is_per_sample_not_per_row() -> None:
    ref = np.ones((2, 3, 4))
    got = ref.copy()
    got[0, 0] = -1  # one row of sample 0 flipped
    cos = sample_cosines(got, ref)
    assert cos.shape == (2,) and cos[1] == pytest.approx(1.0) and cos[0] == pytest.approx(1 / 3)
    assert np.isnan(sample_cosines(np.zeros((1, 4)), np.zeros((1, 4))))[0]
    assert sample_cosines(np.zeros((1, 4)), np.ones((1, 4)))[0] == 0.0
    assert sample_cosines(np.full((1, 4), np.inf), np.ones((1, 4)))[0] == 0.0


def test_all_zero_reference_warns_and_does_not_score_one(caplog: pytest.LogCaptureFixture) -> None:
    """An FP32 output that is all zero on every sample warns, scores no sample (no cosine: NaN, null in JSON),
    and the gate refuses to pass on it, even for a candidate that is exactly zero too, with a summary that names
    the cause; a candidate that is not zero there fails as well."""
    zero = _scale_chain([0.0])
    batches = [{"x": X}]
    with caplog.at_level("WARNING"):
        evaluator = _evaluator(zero, batches)
    assert any("all zero on 4 of 4 samples" in w for w in evaluator.warnings)
    assert "all zero" in caplog.text
    same = evaluator.evaluate(zero)
    assert np.isnan(same.cosine_mean) and same.warnings and (same.scored, same.samples) == (0, 4)
    assert not same.passed and same.nothing_scored  # identical zeros prove nothing
    assert json.loads(json.dumps(same.to_dict(), allow_nan=False))["cosine_mean"] is None
    assert same.summary().startswith("no sample scored: FP32 output") and "all zero on every one of the 4" in \
        same.summary()
    assert not evaluator.evaluate(_scale_chain([1.0])).passed  # non-zero where FP32 is zero


def test_constant_reference_warns() -> None:
    batches = [{"x": np.ones((4, 8), np.float32)}]
    assert any("same for every sample" in w for w in _evaluator(_scale_chain([2.0]), batches).warnings)


def test_the_reference_outputs_are_read_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP32 top-1 and the degenerate-reference warnings come from one read of the files written."""
    from calibration import accuracy

    read: list[Any] = []
    real = accuracy._row_blocks

    def counting(item: Any, budget_bytes: int) -> Any:
        read.append(item)
        return real(item, budget_bytes)

    monkeypatch.setattr(accuracy, "_row_blocks", counting)
    labels = np.array([7, 7, 7, 7, 0, 7])  # every row of X rises: class 7
    evaluator = Evaluator.from_model(_scale_chain([2.0]), [{"x": X}, {"x": X[:2]}], labels, GateSettings(),
                                     providers=["CPUExecutionProvider"])
    assert len(read) == len(set(read)) == 2  # one output, two batches, each file once
    assert evaluator.fp32_top1 == pytest.approx(5 / 6) and evaluator.warnings == []


def test_checking_providers_prefer_cuda_and_never_tensorrt() -> None:
    everything = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert checking_providers(everything, cuda=True) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert checking_providers(everything, cuda=False) == ["CPUExecutionProvider"]
    assert checking_providers(["CPUExecutionProvider"], cuda=True) == ["CPUExecutionProvider"]
    assert checking_providers()[-1] == "CPUExecutionProvider"


def test_the_report_prints_an_all_zero_gate_as_n_a(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    from compiler.core import report

    evaluator = _evaluator(_scale_chain([0.0]), [{"x": X}])
    entry = {"precision": "fp16", "accuracy": evaluator.evaluate(_scale_chain([0.0])).to_dict(), "kept_in_fp32": {}}
    report._print_accuracy_entry("fp16", entry, tmp_path)
    printed = capsys.readouterr()
    assert "n/a" in printed.out + printed.err and "all zero" in printed.out + printed.err


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_the_provider_is_recorded_and_the_work_runs_in_a_worker(tmp_path: Any, precision: str) -> None:
    from calibration.calibrate import calibrated_into
    from compiler.core.onnx_io import save_onnx
    from compiler.core.settings import CalibrationSettings
    from compiler.core.specs import ModelSpec, parse_input_spec

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")], "mlp", [x], [y],
        [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    save_onnx(model, tmp_path / "model.onnx")
    stage = tmp_path / "stage"
    stage.mkdir()
    outcome = calibrated_into(stage, tmp_path / "model.onnx", ModelSpec((parse_input_spec("x:Bx16"),)),
                              CalibrationSettings(precision, data="random", samples=32))
    provider = checking_providers()[0]
    assert outcome.record is not None, outcome.message
    assert outcome.record.accuracy["provider"] == provider
    if precision == "int8":
        assert outcome.record.calibration is not None and outcome.record.calibration["provider"] == provider
        assert json.loads((stage / "calibration.json").read_text())["provider"] == provider
    else:
        assert outcome.record.fp16 is not None and outcome.record.fp16["range_provider"] == provider
    gate = json.loads((stage / "report" / "accuracy.json").read_text())[precision]["accuracy"]
    assert gate["provider"] == provider
    # INT8 keeps an FP16 remainder, so on the CPU both precisions run the FP16 rounding emulation
    assert gate["fp16_emulated"] == provider.startswith("CPU")


def _wide(width: int, scale: float = 1.0) -> onnx.ModelProto:
    """y = x @ W with W [4, width]: each sample's output is ``width`` floats, a language model's logits in small."""
    w = np.random.default_rng(1).standard_normal((4, width)).astype(np.float32) * np.float32(scale)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", width])
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "wide",
                                                [x], [y], [numpy_helper.from_array(w, "w")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


_PEAK_SCRIPT = """
import resource, sys
import numpy as np
from calibration.accuracy import Evaluator
from compiler.core.settings import GateSettings
from calibration.fp16 import fp16_model_from
from tests.calibration.test_accuracy import _wide

model = _wide(1 << 16)  # 256 KiB of output per sample
candidate = fp16_model_from(model)[0]
batches = [{"x": np.random.default_rng(2).standard_normal((int(sys.argv[1]), 4)).astype(np.float32)}]
kwargs = {"budget_bytes": int(sys.argv[2])} if len(sys.argv) > 2 else {}
evaluator = Evaluator.from_model(model, batches, None, GateSettings(), providers=["CPUExecutionProvider"], **kwargs)
result = evaluator.evaluate(candidate)
assert result.passed and result.fp16_emulated, result.summary()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _gate_peak_rss(samples: int, budget: int) -> int:
    """Peak RSS in bytes of a fresh process that builds the FP32 reference and gates an FP16 candidate."""
    import os
    import subprocess
    import sys

    # a fixed mmap threshold: glibc's dynamic one rises after the first large free, and freed slices may then stay
    # in its heap run after run, which measures the allocator's caching, not what the gate holds
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(samples), str(budget)], env=env,
                          capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_the_gates_peak_rss_does_not_grow_with_the_batch() -> None:
    # a 1 MiB budget: slices of 4 samples. The whole batch's outputs are 32 and 128 MiB; held from both
    # models (the reference paged in from its file) they would add 192 MiB to the larger batch's peak
    small, large = _gate_peak_rss(128, 1 << 20), _gate_peak_rss(512, 1 << 20)
    assert large - small < 24 << 20, f"peak RSS {small / 2**20:.0f} MiB at 128 samples, {large / 2**20:.0f} at 512"


def test_sliced_evaluation_is_exact() -> None:
    model, candidate = _wide(1000), _wide(1000, scale=1.01)
    candidate.graph.initializer[0].CopyFrom(numpy_helper.from_array(
        numpy_helper.to_array(candidate.graph.initializer[0]) + np.float32(0.05), "w"))
    batches = [{"x": np.random.default_rng(3).standard_normal((n, 4)).astype(np.float32)} for n in (7, 5)]
    before = candidate.SerializeToString()
    results = [Evaluator.from_model(model, batches, None, GateSettings(), providers=["CPUExecutionProvider"],
                                    budget_bytes=budget).evaluate(candidate) for budget in (1, 3 * 4000, 1 << 30)]
    assert candidate.SerializeToString() == before  # the candidate was written for ONNX Runtime, not changed
    assert results[0].cosine_mean < 0.9999  # the candidate differs
    for result in results[1:]:
        assert result.per_output["y"] == pytest.approx(results[0].per_output["y"], rel=1e-12)
        assert result.cosine_min == pytest.approx(results[0].cosine_min, rel=1e-12)


def test_layer_ranking_in_slices_is_exact() -> None:
    from calibration.sensitivity import layer_errors

    model, candidate = _wide(1000), fp16_model_from(_wide(1000))[0]
    batches = [{"x": np.random.default_rng(4).standard_normal((9, 4)).astype(np.float32) * 300}]
    errors = [layer_errors(candidate, model, ["mm"], batches, budget_bytes=b) for b in (1, 1 << 30)]
    assert errors[0]["mm"] > 0 and errors[0] == pytest.approx(errors[1], rel=1e-9)


def zero_head() -> nn.Module:
    """A small MLP whose last layer is zero-initialised (weights and bias): its FP32 output is zero for every input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    nn.init.zeros_(model[2].weight)
    nn.init.zeros_(model[2].bias)
    return model.eval()


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_a_gate_that_scores_no_sample_fails_in_one_line(tmp_path: Path, precision: str) -> None:
    """`trtc build` of a model whose only output is all zero on every evaluation sample exits 3 with one line
    that names the cause (no sample scored, the output, the sample count) instead of passing on zero samples;
    no reduced graph is written, no traceback is printed."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((32, 16)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=rng.standard_normal((16, 16)).astype(np.float32))
    out = tmp_path / "m"
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", f"{__name__}:zero_head", "--input", "x:Bx16",
                                      f"--{precision}", "--buckets", "1,4", "--calib-data", str(tmp_path / "calib.npz"),
                                      "--eval-data", str(tmp_path / "eval.npz"), "--engine", "none", "--out",
                                      str(out)])
    assert result.exit_code == 3, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: the {precision} accuracy gate cannot pass: no sample scored: FP32 output")
    assert "all zero on every one of the 16 evaluation samples" in last and "Traceback" not in result.output
    assert not list(out.rglob(f"model.{precision}.onnx"))
