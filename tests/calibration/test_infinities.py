"""Infinities a model computes from finite inputs and masks away (T5's log(0) in its relative-position buckets) are
not data errors: they stay out of the ranges, the tensors holding them stay out of INT8, FP16 keeps them, and
INT8 and FP16 build at default settings. NaN, and infinities in a graph output, are still refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import helper
from torch import nn

import compiler
from calibration.observe import collect_histograms, collect_max_abs
from compiler.cli import cli
from compiler.core.errors import CalibrationError
from tests.onnx_helpers import make_model, tensor

RNG = np.random.default_rng(0)


class MaskedLog(nn.Module):
    """T5's relative-position bucketing in miniature: log(|i - j| / 4) is -inf on the diagonal, and the Where that
    picks the exact bucket for small distances masks it away; the bucket's bias enters attention scores."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = (nn.Linear(16, 16) for _ in range(4))
        self.table = nn.Embedding(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        rel = (pos[None, :] - pos[:, None]).abs()
        large = 4 + (torch.log(rel.float() / 4) / math.log(16 / 4) * 4).to(torch.long)
        bucket = torch.where(rel < 4, rel, torch.min(large, torch.full_like(large, 7)))
        scores = self.q(x) @ self.k(x).transpose(1, 2) + self.table(bucket)[..., 0]
        return self.out(torch.softmax(scores, -1) @ self.v(x))


class InfinityPooled(nn.Module):
    """A residual add of a convolution with a shape-derived -inf column mask (log(0) at even columns), max-pooled
    away: the add would take an INT8 shortcut, on which the -inf would become the lowest finite level."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2, self.c3 = (nn.Conv2d(16, 16, 3, padding=1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.log((torch.arange(x.shape[-1], device=x.device) % 2).float())
        h = self.c2(torch.relu(self.c1(x))) + mask
        return self.c3(nn.functional.max_pool2d(h, (1, 2), (1, 2)))


def masked_log() -> nn.Module:
    return MaskedLog().eval()


def infinity_pooled() -> nn.Module:
    return InfinityPooled().eval()


def _build(tmp_path: Path, factory: str, shape: tuple[int, ...], flags: list[str], precision: str) -> Path:
    np.savez(tmp_path / "calib.npz", x=RNG.standard_normal((32, *shape)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=RNG.standard_normal((16, *shape)).astype(np.float32))
    out = tmp_path / "m"
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", f"{__name__}:{factory}", *flags,
                                      f"--{precision}", "--buckets", "1,4", "--calib-data", str(tmp_path / "calib.npz"),
                                      "--eval-data", str(tmp_path / "eval.npz"), "--engine", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _cosine(got: np.ndarray, want: np.ndarray) -> float:
    a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_a_masked_log_of_zero_builds_at_defaults(tmp_path: Path, precision: str) -> None:
    """The T5-style model (its eager outputs finite, its Log output -inf on the diagonal) builds INT8 and FP16 at
    default settings; the reduced graph, loaded through ``compiler.load`` on ONNX Runtime, gives finite outputs
    within the gate's cosine of eager PyTorch; for INT8, calibration.json counts the Log's infinities."""
    out = _build(tmp_path, "masked_log", (8, 16), ["--input", "x:BxSx16", "--dim", "S=4:8:16"], precision)
    x = np.load(tmp_path / "eval.npz")["x"][:4]
    with torch.no_grad():
        want = masked_log()(torch.from_numpy(x)).numpy()
    assert np.isfinite(want).all()
    got = np.asarray(compiler.load(out, backend="onnxruntime", device="cpu", precision=precision)(x))
    assert np.isfinite(got).all() and _cosine(got, want) >= 0.99
    if precision == "int8":
        infinite = json.loads((out / "calibration.json").read_text())["infinite_values"]
        assert any("log" in name.lower() for name in infinite) and all(n > 0 for n in infinite.values())


def test_tensors_holding_the_models_infinities_stay_out_of_int8(tmp_path: Path) -> None:
    """The -inf column mask gets no Q/DQ (no QuantizeLinear reads a tensor calibration.json lists as infinite),
    and the INT8 graph passes the gate without any layer kept by the fallback; its outputs stay within 0.99 cosine
    of eager PyTorch (a quantized -inf, the lowest INT8 level, would survive the max-pool: cosine 0.66 here)."""
    out = _build(tmp_path, "infinity_pooled", (16, 8, 8), ["--input", "x:Bx16x8xW", "--dim", "W=4:8:16"], "int8")
    infinite = set(json.loads((out / "calibration.json").read_text())["infinite_values"])
    graph = onnx.load(str(out / "model.int8.onnx"), load_external_data=False).graph
    quantized = {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
    assert infinite and not infinite & quantized and quantized  # the convolutions are still INT8
    report = json.loads((out / "report" / "accuracy.json").read_text())["int8"]
    assert report["accuracy"]["passed"] and report["kept_in_fp32"] == {}
    x = np.load(tmp_path / "eval.npz")["x"][:4]
    with torch.no_grad():
        want = infinity_pooled()(torch.from_numpy(x)).numpy()
    got = np.asarray(compiler.load(out, backend="onnxruntime", device="cpu", precision="int8")(x))
    assert _cosine(got, want) >= 0.99


def _log_graph(output_log: bool) -> onnx.ModelProto:
    """h = log(relu(x)) (-inf where x <= 0); y = exp(h) = relu(x) (finite), or y = h itself (an infinite output)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Log", ["r"], ["h" if not output_log else "y"])]
    if not output_log:
        nodes.append(helper.make_node("Exp", ["h"], ["y"]))
    return make_model(nodes, [tensor("x", ["B", 8])], [tensor("y", ["B", 8])], {})


def test_infinities_are_counted_and_left_out_of_ranges_nan_and_infinite_outputs_raise() -> None:
    """On finite inputs, the probe leaves an intermediate's -inf out of its histogram and its max |x| and counts
    each one; an infinite graph output and a NaN still raise CalibrationError naming the batch and the tensor."""
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    negatives = int((x <= 0).sum())
    model = _log_graph(output_log=False)
    stats = collect_histograms(model, ["h"], [{"x": x}], providers=["CPUExecutionProvider"], max_abs_names=["h"])
    finite = np.log(np.maximum(x, 0)[x > 0])
    assert stats.infinite == {"h": negatives}
    assert stats.histograms["h"].amax == pytest.approx(float(np.abs(finite).max()), rel=1e-6)
    assert stats.max_abs is not None and stats.max_abs["h"] == pytest.approx(float(np.abs(finite).max()), rel=1e-6)
    assert collect_max_abs(model, ["h"], [{"x": x}])["h"] == pytest.approx(float(np.abs(finite).max()), rel=1e-6)
    with pytest.raises(CalibrationError, match="batch 0: tensor 'y' has"):
        collect_max_abs(_log_graph(output_log=True), ["y"], [{"x": x}])
    with pytest.raises(CalibrationError, match="batch 0: tensor 'y' has"):
        collect_histograms(_log_graph(output_log=True), ["y"], [{"x": x}])
    nan = make_model([helper.make_node("Sqrt", ["x"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                     [tensor("x", ["B", 8])], [tensor("y", ["B", 8])], {})
    for run in (collect_histograms, collect_max_abs):
        with pytest.raises(CalibrationError, match="batch 0: tensor 'h' has"):
            run(nan, ["h"], [{"x": x}])


def test_max_abs_is_exact_where_infinities_appear_in_a_later_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-graph max |x| starts from each tensor's bounds (max, min, sum); a batch on which a tensor's bounds are
    not finite (here h = log(relu(x)) on the second batch, whose x holds zeros) runs again with that tensor's exact
    reduction, in a new session: the max |x| of its finite values and its count of infinities are those numpy
    gives over all batches, and the other tensor (r, finite throughout) keeps the bounds' value, max |r|."""
    from calibration import observe
    from compiler.core.onnx_io import ort_session

    sessions: list[Any] = []

    def recording_session(*args: Any, **kwargs: Any) -> Any:
        sessions.append(ort_session(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(observe, "ort_session", recording_session)
    positive = np.abs(RNG.standard_normal((4, 8))).astype(np.float32) + 0.5
    mixed = RNG.standard_normal((4, 8)).astype(np.float32)
    batches = [{"x": positive}, {"x": mixed}, {"x": positive * 3}]
    model = _log_graph(output_log=False)
    stats = collect_histograms(model, [], batches, max_abs_names=["r", "h"])
    both = np.concatenate([b["x"] for b in batches])
    logs = np.log(np.maximum(both, 0)[both > 0])
    assert stats.max_abs is not None
    assert stats.max_abs["h"] == pytest.approx(float(np.abs(logs).max()), rel=1e-6)
    assert stats.max_abs["r"] == float(np.maximum(both, 0).max())
    assert stats.infinite == {"h": int((mixed <= 0).sum())}
    # one session on the bounds, one more once h's were not finite (batch 1); batch 2 runs on the second
    assert [sum(o.shape == [] for o in s.get_outputs()) for s in sessions] == [3 + 3, 3 + 2]
    assert collect_max_abs(model, ["h", "r"], batches) == stats.max_abs
