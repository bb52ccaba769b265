"""The accuracy gate: compare a reduced-precision model with FP32 and fall back layer by layer.

With labels the gate is on top-1 accuracy (drop in percentage points); without, on cosine similarity
to the FP32 outputs, sample by sample over each whole output (a sample's logits, all its token
embeddings, all its boxes and scores, its whole segmentation map), averaged over samples per output;
the worst output's mean must reach ``min_cosine`` and is named in the summary. A sample whose FP32
output is all zero has no direction to compare: it is left out of the mean (a candidate that is not
all zero there still counts as cosine 0), and the result warns about it, as about an output that is
the same for every sample. Models run on ONNX Runtime's CUDA provider where there is one, else the
CPU; on the CPU an FP16 candidate runs as ``fp16_rounding_emulation`` so that its values round,
underflow and overflow as FP16 hardware stores them. When the candidate misses the gate, the
candidate layers are ranked in one pass: each runs beside an FP32 twin that reads the same
inputs, so one ONNX Runtime run per batch measures every layer's own error; then the most
sensitive layers are kept in higher precision one at a time until the gate passes or
``max_fallback`` is reached.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from calibration.fp16_rounding import fp16_rounding_emulation
from calibration.sensitivity import layer_errors
from calibration.slices import CHUNK_VALUES, SampleBytes, leading_samples, sliced_runs, takes_any_batch
from compiler.backends.base import Runner
from compiler.backends.registry import check_runner
from compiler.core import defaults
from compiler.core.capabilities import checking_providers
from compiler.core.onnx_io import TemporaryOnnxFile, load_onnx, load_onnx_by_reference
from compiler.core.settings import GateSettings

__all__ = ["GateSettings", "AccuracyResult", "Evaluator", "GateOutcome", "gate_with_fallback", "sample_cosines"]

log = logging.getLogger(__name__)


@dataclass
class AccuracyResult:
    metric: str  # "top1" | "cosine"
    passed: bool
    fp32_top1: float | None
    top1: float | None
    drop_points: float | None
    cosine_mean: float  # the worst output's mean per-sample cosine; NaN where no sample could be compared
    cosine_min: float  # the lowest per-sample cosine of any output
    max_abs: float
    worst_output: str | None = None
    per_output: dict[str, dict[str, float | None]] = field(default_factory=dict)  # cosine_mean, cosine_min, max_abs
    warnings: list[str] = field(default_factory=list)  # degenerate references: all zero, constant
    provider: str = "CPUExecutionProvider"
    fp16_emulated: bool = False  # an FP16 candidate ran as fp16_rounding_emulation (on the CPU)
    scored: int | None = None  # samples with a cosine on the output that has the most; None: not counted
    samples: int | None = None  # evaluation samples

    @property
    def nothing_scored(self) -> bool:
        """No sample has a cosine on any output (every FP32 output all zero on every sample): nothing was proven."""
        return self.metric == "cosine" and self.scored == 0

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))

    def summary(self) -> str:
        if self.nothing_scored:
            names = ", ".join(self.per_output) or "every output"
            return (f"no sample scored: FP32 output {names} is all zero on every one of the {self.samples} evaluation "
                    "samples, so no cosine exists (a zero-initialised head? check the weights and --eval-data)")
        cosine = "n/a (all-zero FP32 outputs)" if np.isnan(self.cosine_mean) else f"{self.cosine_mean:.5f}"
        where = f" on output {self.worst_output}" if self.worst_output and len(self.per_output) > 1 else ""
        if self.metric == "top1":
            return (f"top-1 {100 * (self.top1 or 0):.2f}% vs FP32 {100 * (self.fp32_top1 or 0):.2f}% "
                    f"(drop {self.drop_points:.2f} points), cosine {cosine}{where}")
        return f"cosine {cosine}{where} (min {self.cosine_min:.5f}), max abs error {self.max_abs:.3g}"


def _json_safe(value: Any) -> Any:
    """NaN and inf as None, so that accuracy.json stays strict JSON."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def sample_cosines(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The cosine similarity of each sample's whole output: axis 0 is the batch, the rest is flattened.

    NaN where both are all zero (nothing to compare: neither 1 nor 0 would be true), 0 where exactly one
    is, and 0 where the candidate holds NaN or inf. A 0-d output is one sample.
    """
    return _SampleComparison.of(got, ref).cosines()




@dataclass
class _SampleComparison:
    """Per-sample sums of a comparison, accumulated in float64 over chunks of at most ``CHUNK_VALUES`` values.

    Numpy has no float64 dot of float32 arrays without a float64 copy, so the copies are made a chunk
    at a time: what the comparison holds does not grow with the size of an output.
    """

    dot: np.ndarray
    got_sq: np.ndarray
    ref_sq: np.ndarray
    finite: np.ndarray
    max_abs: np.ndarray  # per sample, NaN differences ignored

    @classmethod
    def of(cls, got: np.ndarray, ref: np.ndarray) -> _SampleComparison:
        a = got.reshape(len(got), -1) if got.ndim else got.reshape(1, 1)
        b = ref.reshape(len(ref), -1) if ref.ndim else ref.reshape(1, 1)
        n, m = a.shape
        sums = cls(np.zeros(n), np.zeros(n), np.zeros(n), np.ones(n, bool), np.zeros(n))
        rows, cols = max(1, CHUNK_VALUES // max(m, 1)), max(1, min(m, CHUNK_VALUES))
        for r in range(0, n, rows):
            for c in range(0, m, cols):
                x = a[r:r + rows, c:c + cols].astype(np.float64)
                y = b[r:r + rows, c:c + cols].astype(np.float64)
                ok = np.isfinite(x)
                sums.finite[r:r + rows] &= ok.all(axis=1)
                diff = np.abs(x - y)
                sums.max_abs[r:r + rows] = np.maximum(
                    sums.max_abs[r:r + rows], np.max(diff, axis=1, where=~np.isnan(diff), initial=0.0))
                x = np.where(ok, x, 0.0)
                sums.dot[r:r + rows] += np.einsum("ij,ij->i", x, y)
                sums.got_sq[r:r + rows] += np.einsum("ij,ij->i", x, x)
                sums.ref_sq[r:r + rows] += np.einsum("ij,ij->i", y, y)
        return sums

    def cosines(self) -> np.ndarray:
        na, nb = np.sqrt(self.got_sq), np.sqrt(self.ref_sq)
        den = na * nb
        cos = np.where(den > 0, self.dot / np.where(den > 0, den, 1.0), 0.0)
        cos = np.where((na == 0) & (nb == 0), np.nan, cos)
        return np.where(self.finite, cos, 0.0)


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
    the evaluation set (only the outputs are kept). ``providers`` run both the reference and every
    candidate (``checking_providers()`` by default: CUDA where present, else the CPU).

    Memory: a batch runs in slices whose outputs stay under ``budget_bytes`` (the calibration budget,
    64 MiB by default; one sample a run at least), and each slice is compared as it comes, so the gate
    holds one slice of outputs from each model whatever the batch size (GPT-2's logits are 25 MB a
    128-token sample). Reference outputs computed by :meth:`from_model` wait in files, and only the
    slice being compared is read back. Per-sample cosines make the slicing exact.
    """

    def __init__(self, batches: Iterable[dict[str, np.ndarray]], fp32_outputs: list[list[np.ndarray | Path]],
                 labels: np.ndarray | None, settings: GateSettings, output_names: list[str] | None = None,
                 providers: list[str] | None = None, budget_bytes: int = defaults.CALIB_MEMORY_BUDGET) -> None:
        self.batches = batches
        self.reference = fp32_outputs  # per batch, per output: an array, or the .npy file holding it
        self.labels = labels
        self.settings = settings
        self.budget_bytes = budget_bytes
        count = len(fp32_outputs[0]) if fp32_outputs else 0
        self.output_names = list(output_names or [f"output {i}" for i in range(count)])
        self.providers = list(providers or ["CPUExecutionProvider"])
        self._scratch: tempfile.TemporaryDirectory[str] | None = None  # reference outputs
        self.sample_bytes = SampleBytes()  # what the reference's first slice measured: candidates run whole batches
        self.warnings, predictions, self.reference_max_abs = _read_reference(
            self.output_names, fp32_outputs, budget_bytes, predictions=labels is not None)
        self.fp32_top1 = self._top1(predictions) if labels is not None else None
        for warning in self.warnings:
            log.warning("accuracy gate: %s", warning)

    @classmethod
    def from_model(cls, fp32: onnx.ModelProto | str, batches: Iterable[dict[str, np.ndarray]],
                   labels: np.ndarray | None, settings: GateSettings, providers: list[str] | None = None,
                   budget_bytes: int = defaults.CALIB_MEMORY_BUDGET) -> Evaluator:
        providers = providers or checking_providers()
        runner = check_runner("onnxruntime", fp32, providers, memory_arena=False)
        runner.activate()
        # the reference outputs go to files, written slice by slice: a language model's logits for every
        # evaluation sample would otherwise be held in memory (GPT-2: 25 MB per 128-token sample)
        scratch = tempfile.TemporaryDirectory(prefix="trtc-reference-")
        outputs: list[list[np.ndarray | Path]] = []
        known = SampleBytes()
        for i, batch in enumerate(batches):
            paths = [Path(scratch.name) / f"{i}-{j}.npy" for j in range(len(runner.output_names))]
            files: list[Any] = []
            try:
                for _start, stop, outs in sliced_runs(runner.infer, batch, budget_bytes, f"batch {i}",
                                                      takes_any_batch(runner), known):
                    if stop is None:  # not sliceable: the batch ran whole
                        for path, array in zip(paths, outs):
                            np.save(path, array)
                        continue
                    if not files:
                        files = [_open_npy(path, array, leading_samples(batch)) for path, array in zip(paths, outs)]
                    for file, array in zip(files, outs):
                        np.ascontiguousarray(array).tofile(file)
            finally:
                for file in files:
                    file.close()
            outputs.append(list(paths))
        names = runner.output_names
        runner.release()
        evaluator = cls(batches, outputs, labels, settings, names, providers, budget_bytes)
        evaluator._scratch = scratch  # removed with the evaluator
        evaluator.sample_bytes = known
        return evaluator

    def _top1(self, predictions: list[np.ndarray]) -> float:
        assert self.labels is not None
        pred = np.concatenate(predictions)
        return float((pred == self.labels[: len(pred)]).mean())

    def _runner(self, model: onnx.ModelProto | str) -> tuple[Runner, bool]:
        """An active runner on ``model``, or on its FP16 rounding emulation on the CPU.

        An in-memory model is saved (weights as external data) and ONNX Runtime reads the file: a
        serialized copy next to the proto, and ONNX Runtime's parse of it, would hold the weights twice more.
        """
        proto = model if isinstance(model, onnx.ModelProto) else None
        emulate = self.providers[0] == "CPUExecutionProvider" \
            and _holds_fp16(proto if proto is not None else load_onnx(model, load_weights=False))
        if emulate:
            proto = fp16_rounding_emulation(proto if proto is not None else load_onnx_by_reference(model))
        if proto is None:
            runner = check_runner("onnxruntime", model, self.providers, memory_arena=False)
            runner.activate()
            return runner, False
        with TemporaryOnnxFile(proto, prefix="trtc-gate-") as path:
            del proto  # the emulation: ONNX Runtime reads the file
            runner = check_runner("onnxruntime", str(path), self.providers, memory_arena=False)
            runner.activate()  # the session reads the file now, before the block removes it
            return runner, emulate

    def evaluate(self, model: onnx.ModelProto | str) -> AccuracyResult:
        """Run ``model`` (Q/DQ executed exactly, as TensorRT would; FP16 rounded as FP16 hardware) against FP32."""
        provider = self.providers[0]
        runner, emulated = self._runner(model)
        cosines: dict[str, list[np.ndarray]] = {name: [] for name in self.output_names}
        max_abs = dict.fromkeys(self.output_names, 0.0)
        predictions: list[np.ndarray] = []
        sliceable = takes_any_batch(runner)
        for index, (batch, ref) in enumerate(zip(self.batches, self.reference)):
            for start, stop, outs in sliced_runs(runner.infer, batch, self.budget_bytes, f"batch {index}",
                                                      sliceable, self.sample_bytes):
                if self.labels is not None:
                    predictions.append(_argmax(outs[0]))
                for name, got, item in zip(self.output_names, outs, ref):
                    if got.dtype.kind != "f":
                        continue
                    sums = _SampleComparison.of(got, _part(item, start, stop))
                    cosines[name].append(sums.cosines())
                    max_abs[name] = max(max_abs[name], float(sums.max_abs.max(initial=0.0)))
                del outs
        runner.release()
        per_output: dict[str, dict[str, float | None]] = {}
        scored, samples = 0, 0
        for name, parts in cosines.items():
            if not parts:
                continue
            cos = np.concatenate(parts)
            known = cos[~np.isnan(cos)]
            scored, samples = max(scored, known.size), max(samples, cos.size)
            per_output[name] = {"cosine_mean": float(known.mean()) if known.size else float("nan"),
                                "cosine_min": float(known.min()) if known.size else float("nan"),
                                "max_abs": max_abs[name], "fp32_max_abs": self.reference_max_abs.get(name)}
        worst = _worst(per_output)
        mean = float(per_output[worst]["cosine_mean"]) if worst else float("nan")  # type: ignore[arg-type]
        mins = [float(v["cosine_min"]) for v in per_output.values() if v["cosine_min"] is not None
                and not np.isnan(float(v["cosine_min"]))]
        low = min(mins) if mins else float("nan")
        worst_abs = max(max_abs.values()) if max_abs else 0.0
        # nothing comparable (every FP32 sample of every output all zero): nothing proven, no pass
        cos_ok = bool(scored) and mean >= self.settings.min_cosine
        result = AccuracyResult("cosine", cos_ok, None, None, None, mean, low, worst_abs, worst, per_output,
                                list(self.warnings), provider, emulated, scored, samples)
        if self.labels is not None:
            result.metric, result.fp32_top1, result.top1 = "top1", self.fp32_top1, self._top1(predictions)
            result.drop_points = 100 * ((self.fp32_top1 or 0) - result.top1)
            result.passed = result.drop_points <= self.settings.max_accuracy_drop
        return result


def _open_npy(path: Path, first: np.ndarray, samples: int) -> Any:
    """A .npy file open for appending the ``samples`` samples of an output shaped like ``first`` (one slice)."""
    file = path.open("wb")
    header = {"descr": np.lib.format.dtype_to_descr(first.dtype), "fortran_order": False,
              "shape": (samples, *first.shape[1:])}
    np.lib.format.write_array_header_2_0(file, header)
    return file


def _part(item: np.ndarray | Path, start: int, stop: int | None) -> np.ndarray:
    """Samples ``start:stop`` of a reference output (all of it when ``stop`` is None).

    From a file, only that slice is read, and its mapping is closed again: pages of a memory-mapped file
    count in the process's RSS for as long as it stays mapped.
    """
    if isinstance(item, Path):
        mapped = np.load(item, mmap_mode="r")
        part = np.array(mapped[start:stop] if stop is not None and mapped.ndim else mapped)
        del mapped
        return part
    return item[start:stop] if stop is not None and item.ndim else item


def _row_blocks(item: np.ndarray | Path, budget_bytes: int) -> Iterator[np.ndarray]:
    """A reference output in blocks of whole samples of at most ``budget_bytes`` (one sample at least)."""
    if isinstance(item, Path):
        mapped = np.load(item, mmap_mode="r")
        shape, itemsize = mapped.shape, mapped.dtype.itemsize
        del mapped
    else:
        shape, itemsize = item.shape, item.dtype.itemsize
    if not shape:
        yield _part(item, 0, None).reshape(1)
        return
    per_sample = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    rows = max(1, budget_bytes // per_sample)
    for start in range(0, shape[0], rows):
        yield _part(item, start, start + rows)


def _argmax(output: np.ndarray) -> np.ndarray:
    return output.reshape(len(output), -1).argmax(axis=1) if output.ndim else output.reshape(1)


def _worst(per_output: dict[str, dict[str, float | None]]) -> str | None:
    """The output with the lowest mean cosine (NaN ones only when nothing else was comparable)."""
    if not per_output:
        return None
    def key(name: str) -> float:
        value = per_output[name]["cosine_mean"]
        return np.inf if value is None or np.isnan(value) else value
    return min(per_output, key=key)


def _holds_fp16(model: onnx.ModelProto) -> bool:
    """Whether the graph computes anything in FP16: FP16 weights, FP16 values or a Cast to FP16."""
    graph = model.graph
    return any(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.initializer) \
        or any(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
               for vi in [*graph.input, *graph.output, *graph.value_info]) \
        or any(n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute)
               for n in graph.node)


def _read_reference(names: list[str], outputs: list[list[np.ndarray | Path]],
                    budget_bytes: int = defaults.CALIB_MEMORY_BUDGET, predictions: bool = False,
                    ) -> tuple[list[str], list[np.ndarray], dict[str, float]]:
    """One read of the FP32 reference outputs: what makes a comparison with them degenerate (all-zero samples,
    one value for all samples), with ``predictions`` each batch's top-1 classes from the first output, and each
    float output's max |x| (finite values).

    Reads the outputs in blocks of at most ``budget_bytes``; holds one sample (the first) besides.
    """
    warnings = []
    classes: list[np.ndarray] = []
    maxima: dict[str, float] = {}
    for k, name in enumerate(names):
        total = zero = 0
        first: np.ndarray | None = None
        same = True
        for batch in outputs:
            if k >= len(batch):
                continue
            top1 = predictions and k == 0
            blocks: list[np.ndarray] = []
            for block in _row_blocks(batch[k], budget_bytes):
                if top1:
                    blocks.append(_argmax(block))
                if block.dtype.kind == "f":
                    rows = block.reshape(len(block), -1)
                    total += len(rows)
                    zero += int((~rows.any(axis=1)).sum())
                    finite = np.abs(rows[np.isfinite(rows)])
                    maxima[name] = max(maxima.get(name, 0.0), float(finite.max()) if finite.size else 0.0)
                    if first is None:
                        first = rows[0].copy()
                    same = same and all(np.array_equal(row, first) for row in rows)
                elif not top1:
                    break  # no cosine for an integer output: nothing more to read
            if top1:
                classes.append(np.concatenate(blocks))
        if not total:
            continue
        if zero:
            warnings.append(f"FP32 output {name} is all zero on {zero} of {total} samples: those samples are left "
                            "out of its cosine (a zero-initialised head? check the weights)")
        if total > 1 and same and zero < total:
            warnings.append(f"FP32 output {name} is the same for every sample: the gate cannot tell a broken "
                            "model from a working one on it (check the data and the weights)")
    return warnings, classes, maxima


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
    if result.passed or not layers or settings.max_fallback == 0 or result.nothing_scored:
        return outcome  # with nothing scored, no layer kept out can make the gate pass
    if reference is None:
        raise ValueError("gate_with_fallback needs the FP32 reference model to rank layers")
    start = time.perf_counter()
    errors = layer_errors(model, reference, layers, _limited(evaluator.batches, settings.sensitivity_samples),
                          evaluator.budget_bytes)
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


