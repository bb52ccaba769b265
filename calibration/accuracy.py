"""The accuracy gate: compare a reduced-precision model with FP32 and fall back layer by layer.

With labels the gate is on top-1 accuracy (drop in percentage points); without, on the mean
cosine similarity between candidate and FP32 outputs, row by row over the last axis (one
logits vector or one token embedding per row). When the candidate misses the gate, every
candidate layer is scored alone (only it in reduced precision, all else FP32) on a subset,
and the most sensitive layers are kept in higher precision one at a time until the gate
passes or ``max_fallback`` is reached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx

from compiler.progress import progress
from compiler.runners import OrtRunner

__all__ = ["GateSettings", "AccuracyResult", "Evaluator", "GateOutcome", "gate_with_fallback"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateSettings:
    max_accuracy_drop: float = 0.5  # top-1 percentage points, with labels
    min_cosine: float = 0.99  # mean row cosine floor, without labels
    max_fallback: int = 8  # layers the gate may keep in higher precision
    sensitivity_samples: int = 64  # samples used to score each layer alone


@dataclass
class AccuracyResult:
    metric: str  # "top1" | "cosine"
    passed: bool
    fp32_top1: float | None
    top1: float | None
    drop_points: float | None
    cosine_mean: float
    cosine_min: float
    max_abs: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if self.metric == "top1":
            return (f"top-1 {100 * (self.top1 or 0):.2f}% vs FP32 {100 * (self.fp32_top1 or 0):.2f}% "
                    f"(drop {self.drop_points:.2f} points), cosine {self.cosine_mean:.5f}")
        return f"cosine {self.cosine_mean:.5f} (min {self.cosine_min:.5f}), max abs error {self.max_abs:.3g}"


def row_cosines(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    a = got.reshape(-1, got.shape[-1]).astype(np.float64) if got.ndim else got.reshape(1, 1).astype(np.float64)
    b = ref.reshape(-1, ref.shape[-1]).astype(np.float64) if ref.ndim else ref.reshape(1, 1).astype(np.float64)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = den == 0
    cos = np.where(both_zero, 1.0, num / np.where(both_zero, 1.0, den))
    return np.where(np.isfinite(a).all(axis=1), cos, 0.0)


class Evaluator:
    """Holds the FP32 reference outputs, computed once, and the evaluation data they came from.

    ``batches`` is iterated once per evaluation, so it must be re-iterable: a list, or a
    ``CalibrationData``, which reads its files again on each pass so that memory does not grow with
    the evaluation set (only the outputs are kept).
    """

    def __init__(self, batches: Iterable[dict[str, np.ndarray]], fp32_outputs: list[list[np.ndarray]],
                 labels: np.ndarray | None, settings: GateSettings) -> None:
        self.batches = batches
        self.reference = fp32_outputs
        self.labels = labels
        self.settings = settings
        self.fp32_top1 = self._top1([out[0] for out in fp32_outputs]) if labels is not None else None

    @classmethod
    def from_model(cls, fp32: onnx.ModelProto | str, batches: Iterable[dict[str, np.ndarray]],
                   labels: np.ndarray | None, settings: GateSettings) -> Evaluator:
        runner = OrtRunner(fp32, ["CPUExecutionProvider"])
        outputs = [list(runner.infer(b).values()) for b in batches]
        return cls(batches, outputs, labels, settings)

    def _top1(self, first_outputs: list[np.ndarray]) -> float:
        assert self.labels is not None
        pred = np.concatenate([o.reshape(len(o), -1).argmax(axis=1) for o in first_outputs])
        return float((pred == self.labels[: len(pred)]).mean())

    def evaluate(self, model: onnx.ModelProto | str, limit: int | None = None) -> AccuracyResult:
        """Run ``model`` (Q/DQ executed exactly, as TensorRT would) and compare with FP32."""
        runner = OrtRunner(model, ["CPUExecutionProvider"], exact_qdq=True)
        cosines: list[np.ndarray] = []
        firsts: list[np.ndarray] = []
        max_abs = 0.0
        seen = 0
        for batch, ref in zip(self.batches, self.reference):
            if limit is not None and seen >= limit:
                break
            outs = list(runner.infer(batch).values())
            firsts.append(outs[0])
            for got, want in zip(outs, ref):
                if got.dtype.kind != "f":
                    continue
                cosines.append(row_cosines(got, want))
                diff = np.abs(got.astype(np.float64) - want)
                max_abs = max(max_abs, float(diff.max()) if diff.size else 0.0)
            seen += len(next(iter(batch.values())))
        cos = np.concatenate(cosines) if cosines else np.ones(1)
        if self.labels is not None and limit is None:
            top1 = self._top1(firsts)
            drop = 100 * ((self.fp32_top1 or 0) - top1)
            passed = drop <= self.settings.max_accuracy_drop
            return AccuracyResult("top1", passed, self.fp32_top1, top1, drop, float(cos.mean()), float(cos.min()),
                                  max_abs)
        return AccuracyResult("cosine", float(cos.mean()) >= self.settings.min_cosine, None, None, None,
                              float(cos.mean()), float(cos.min()), max_abs)


@dataclass
class GateOutcome:
    model: onnx.ModelProto
    result: AccuracyResult
    kept: dict[str, str] = field(default_factory=dict)  # layer -> why it stayed in higher precision
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per gate evaluation


def gate_with_fallback(build: Callable[[frozenset[str]], onnx.ModelProto], layers: list[str], evaluator: Evaluator,
                       what: str, initial: onnx.ModelProto | None = None) -> GateOutcome:
    """Evaluate ``build(frozenset())``; while the gate fails, keep the most sensitive layer out of ``what``.

    ``build(excluded)`` returns the candidate model with the ``excluded`` layers left in FP32;
    ``initial`` is ``build(frozenset())`` when the caller already has it.
    """
    settings = evaluator.settings
    model = initial if initial is not None else build(frozenset())
    result = evaluator.evaluate(model)
    outcome = GateOutcome(model, result, history=[{"excluded": [], **result.to_dict()}])
    log.info("%s accuracy: %s -> %s", what, result.summary(), "pass" if result.passed else "FAIL")
    if result.passed or not layers or settings.max_fallback == 0:
        return outcome
    ranked = _rank_by_sensitivity(build, layers, evaluator)
    excluded: list[str] = []
    for layer, score in ranked[: settings.max_fallback]:
        excluded.append(layer)
        outcome.kept[layer] = (f"kept in FP32 by the accuracy gate: sensitivity rank {len(excluded)} "
                               f"(alone in {what}: cosine {score:.5f} vs FP32)")
        model = build(frozenset(excluded))
        result = evaluator.evaluate(model)
        outcome.history.append({"excluded": list(excluded), **result.to_dict()})
        log.info("%s with %d layer(s) kept in FP32 (+%s): %s -> %s", what, len(excluded), layer, result.summary(),
                 "pass" if result.passed else "FAIL")
        outcome.model, outcome.result = model, result
        if result.passed:
            break
    return outcome


def _rank_by_sensitivity(build: Callable[[frozenset[str]], onnx.ModelProto], layers: list[str],
                         evaluator: Evaluator) -> list[tuple[str, float]]:
    """Each layer alone in reduced precision, scored by mean cosine against FP32; worst first."""
    everything = frozenset(layers)
    scores = []
    with progress("ranking layers by sensitivity", len(layers), unit="layers") as advance:
        for layer in layers:
            result = evaluator.evaluate(build(everything - {layer}), limit=evaluator.settings.sensitivity_samples)
            scores.append((layer, result.cosine_mean))
            advance(1)
    scores.sort(key=lambda item: item[1])
    log.info("most sensitive layers: %s", ", ".join(f"{n} ({c:.5f})" for n, c in scores[:5]))
    return scores
