"""The accuracy gate: compare a reduced-precision model with FP32 and fall back layer by layer.

With labels the gate is on top-1 accuracy (drop in percentage points); without, on the mean
cosine similarity between candidate and FP32 outputs, row by row over the last axis (one
logits vector or one token embedding per row). When the candidate misses the gate, the
candidate layers are ranked in one pass: each runs beside an FP32 twin that reads the same
inputs, so one ONNX Runtime run per batch measures every layer's own error; then the most
sensitive layers are kept in higher precision one at a time until the gate passes or
``max_fallback`` is reached.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx

from compiler.runners import OrtRunner

__all__ = ["GateSettings", "AccuracyResult", "Evaluator", "GateOutcome", "gate_with_fallback", "layer_errors"]

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
    ranking_seconds: float | None = None  # the one-pass layer ranking, when the fallback ran


def gate_with_fallback(build: Callable[[frozenset[str]], onnx.ModelProto], layers: list[str], evaluator: Evaluator,
                       what: str, initial: onnx.ModelProto | None = None, reference: onnx.ModelProto | None = None,
                       kept_as: str = "FP32") -> GateOutcome:
    """Evaluate ``build(frozenset())``; while the gate fails, keep the most sensitive layer out of ``what``.

    ``build(excluded)`` returns the candidate model with the ``excluded`` layers left in higher precision
    (``kept_as`` names it in the report); ``initial`` is ``build(frozenset())`` when the caller already has it.
    Layers are ranked in one pass (:func:`layer_errors`) against ``reference``, the FP32 model whose nodes
    ``layers`` names; then they are kept out one at a time, most sensitive first, up to ``max_fallback``.
    """
    settings = evaluator.settings
    model = initial if initial is not None else build(frozenset())
    result = evaluator.evaluate(model)
    outcome = GateOutcome(model, result, history=[{"excluded": [], **result.to_dict()}])
    log.info("%s accuracy: %s -> %s", what, result.summary(), "pass" if result.passed else "FAIL")
    if result.passed or not layers or settings.max_fallback == 0:
        return outcome
    if reference is None:
        raise ValueError("gate_with_fallback needs the FP32 reference model to rank layers")
    start = time.perf_counter()
    errors = layer_errors(model, reference, layers, _limited(evaluator.batches, settings.sensitivity_samples))
    ranked = sorted(errors.items(), key=lambda item: -item[1])
    outcome.ranking_seconds = round(time.perf_counter() - start, 2)
    log.info("ranked %d layers by their own %s error in one pass (%.1f s); worst: %s", len(ranked), what,
             time.perf_counter() - start, ", ".join(f"{n} ({e:.2e})" for n, e in ranked[:3]))
    excluded: list[str] = []
    for layer, error in ranked[: settings.max_fallback]:
        excluded.append(layer)
        outcome.kept[layer] = (f"kept in {kept_as} by the accuracy gate: sensitivity rank {len(excluded)} "
                               f"(relative squared error of its own output in {what}: {error:.3g})")
        model = build(frozenset(excluded))
        result = evaluator.evaluate(model)
        outcome.history.append({"excluded": list(excluded), **result.to_dict()})
        log.debug("%s with %d layer(s) kept in %s (+%s): %s", what, len(excluded), kept_as, layer,
                  result.summary())
        outcome.model, outcome.result = model, result
        if result.passed:
            break
    log.info("%s with %d layer(s) kept in %s (%s): %s -> %s", what, len(excluded), kept_as, ", ".join(excluded),
             result.summary(), "pass" if result.passed else "FAIL")
    return outcome


def _limited(batches: Iterable[dict[str, np.ndarray]], samples: int) -> Iterator[dict[str, np.ndarray]]:
    seen = 0
    for batch in batches:
        if seen >= samples:
            return
        yield batch
        seen += len(next(iter(batch.values())))


def layer_errors(candidate: onnx.ModelProto, reference: onnx.ModelProto, layers: list[str],
                 batches: Iterable[dict[str, np.ndarray]]) -> dict[str, float]:
    """Each layer's own error in ``candidate``, all layers measured in one ONNX Runtime run per batch.

    Beside each layer of ``candidate`` (INT8 or FP16) runs an FP32 twin: the layer as ``reference`` has it
    (FP32 weights) reading the very inputs the candidate layer reads before their Q/DQ or Cast. The error is
    sum |y - y_fp32|^2 / sum |y_fp32|^2 over ``batches``: what the layer itself loses, not what it inherits
    from the layers before it. ``layers`` names nodes present in both models (the passes keep node names).
    """
    shadow, pairs = _with_fp32_twins(candidate, reference, layers)
    runner = OrtRunner(shadow, ["CPUExecutionProvider"], exact_qdq=True)
    wanted = [name for pair in pairs.values() for name in pair]
    num = dict.fromkeys(pairs, 0.0)
    den = dict.fromkeys(pairs, 0.0)
    for batch in batches:
        outputs = dict(zip(wanted, runner.session.run(wanted, batch)))
        for layer, (got, want) in pairs.items():
            y, ref = outputs[got].astype(np.float64), outputs[want].astype(np.float64)
            num[layer] += float(np.square(y - ref).sum())
            den[layer] += float(np.square(ref).sum())
    return {layer: (num[layer] / den[layer] if den[layer] > 0 else (0.0 if num[layer] == 0 else math.inf))
            for layer in pairs}


def _with_fp32_twins(candidate: onnx.ModelProto, reference: onnx.ModelProto, layers: list[str],
                     ) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]]]:
    """``candidate`` plus, per layer, an FP32 copy of the reference node and both outputs as graph outputs.

    Returns the model and ``{layer: (candidate output, twin output)}``, both FLOAT.
    """
    ref_nodes = {n.name: n for n in reference.graph.node if n.name}
    ref_inits = {t.name: t for t in reference.graph.initializer}
    cand_nodes = {n.name: n for n in candidate.graph.node if n.name}
    out = onnx.ModelProto()
    out.CopyFrom(candidate)
    graph = out.graph
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    taken |= {name for node in graph.node for name in [*node.input, *node.output, node.name]}
    available = {i.name for i in graph.input} | {o for node in graph.node for o in node.output}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        return name

    def as_float(tensor: str) -> str:
        cast = fresh(f"{tensor}_twin_fp32")
        graph.node.append(onnx.helper.make_node("Cast", [tensor], [cast], name=fresh(f"{cast}_cast"),
                                                to=onnx.TensorProto.FLOAT))
        return cast

    pairs: dict[str, tuple[str, str]] = {}
    copied: dict[str, str] = {}
    for layer in layers:
        original, node = ref_nodes.get(layer), cand_nodes.get(layer)
        if original is None or node is None or not node.output:
            continue
        inputs = []
        for tensor in original.input:
            if not tensor:
                inputs.append("")
            elif tensor in ref_inits:
                if tensor not in copied:
                    copied[tensor] = fresh(f"{tensor}_twin")
                    init = onnx.TensorProto()
                    init.CopyFrom(ref_inits[tensor])
                    init.name = copied[tensor]
                    graph.initializer.append(init)
                inputs.append(copied[tensor])
            elif tensor in available:
                inputs.append(as_float(tensor))
            else:
                break
        else:
            twin = onnx.NodeProto()
            twin.CopyFrom(original)
            twin.name = fresh(f"{layer}_twin")
            del twin.input[:]
            twin.input.extend(inputs)
            del twin.output[:]
            twin.output.extend([fresh(f"{o}_twin") if o else "" for o in original.output])
            graph.node.append(twin)
            pairs[layer] = (as_float(node.output[0]), twin.output[0])
    for got, want in pairs.values():
        graph.output.extend([onnx.helper.make_tensor_value_info(got, onnx.TensorProto.FLOAT, None),
                             onnx.helper.make_tensor_value_info(want, onnx.TensorProto.FLOAT, None)])
    return out, pairs
