"""``trtc diff``: where a precision graph's accuracy goes, layer by layer, against FP32 or another build.

``diff_directory(DIR)`` runs the FP32 graph and the precision graph of a build on the same inputs (the build's
evaluation data, else its calibration data, else ``data``) in one ONNX Runtime session (``graphs.comparison_model``)
and gives each layer two errors: **isolated** (the layer alone in its precision, fed the FP32 graph's inputs to
it: what the gate's ranking measures) and **accumulated** (the precision graph end to end, at that layer's
output), each as cosine, relative error (||y - y_ref|| / ||y_ref||) and max |y - y_ref|, and the first layer along
the graph where the accumulated error jumps. ``diff_directories(A, B)`` compares two builds of one model the same
way, A's precision graph the reference. Batches run in slices of samples whose compared activations stay within
the calibration budget, measured on the first sample, as calibration's slices are.
"""

from __future__ import annotations

import gc
import logging
import math
import platform
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from calibration.slices import leading_samples, takes_any_batch
from compiler.backends.base import Runner
from compiler.backends.registry import check_runner
from compiler.core import defaults
from compiler.core.capabilities import checking_providers
from compiler.core.errors import InputError
from compiler.core.files import read_json
from compiler.core.manifest import Manifest, read_manifest
from compiler.core.onnx_io import TemporaryOnnxFile, load_onnx_by_reference
from compiler.core.progress import progress
from compiler.core.settings import REDUCED_PRECISIONS
from compiler.core.worker import mark_step
from compiler.diagnose.graphs import STATS, ComparisonModel, Layer, comparison_model

__all__ = ["Errors", "LayerDiff", "DiffReport", "diff_directory", "diff_directories", "compare_graphs",
           "kept_layers", "SORTS", "JUMP_SHARE"]

log = logging.getLogger(__name__)

SORTS = ("isolated", "accumulated")
# the jump is the first layer whose accumulated error rises over its inputs' by at least this share of the largest
# rise of any layer: the first of the big steps, not the first step of all (every quantized layer adds a little)
JUMP_SHARE = 0.5


@dataclass(frozen=True)
class Errors:
    """One comparison over all samples: ``cosine`` (None where neither holds anything, or on NaN/inf), ``relative``
    (||got - ref|| / ||ref||, inf where ref is all zero and got is not) and ``max_abs``."""

    cosine: float | None
    relative: float
    max_abs: float

    @classmethod
    def of(cls, sums: dict[str, float]) -> Errors:
        diff, ref, got, dot = sums["diff_sq"], sums["ref_sq"], sums["got_sq"], sums["dot"]
        if ref > 0:
            relative = math.sqrt(diff / ref) if math.isfinite(diff) else math.inf
        else:
            relative = 0.0 if diff == 0 else math.inf
        cosine = dot / math.sqrt(got * ref) if got > 0 and ref > 0 and math.isfinite(dot * got) else None
        if got == 0 and ref == 0:
            cosine = 1.0
        return cls(None if cosine is None else max(-1.0, min(1.0, cosine)), relative, sums["max_abs"])

    def to_json(self) -> dict[str, Any]:
        return {"cosine": self.cosine, "relative": _finite(self.relative), "max_abs": _finite(self.max_abs)}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class LayerDiff:
    """One layer: what ``graphs.Layer`` says of it, why it was kept out of the reduced precision (``kept``, None
    when it was not), its ``isolated`` (None where it cannot be isolated: ``why_not_isolated``) and
    ``accumulated`` errors, ``rise`` (its accumulated relative error over the largest of its inputs') and whether
    it is the ``jump``."""

    layer: Layer
    accumulated: Errors
    isolated: Errors | None = None
    kept: str | None = None
    rise: float = 0.0
    jump: bool = False
    why_not_isolated: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer.name, "op_type": self.layer.op_type, "precision": self.layer.precision,
                "depth": self.layer.depth, "kept": self.kept,
                "isolated": self.isolated.to_json() if self.isolated else None,
                "accumulated": self.accumulated.to_json(), "rise": _finite(self.rise), "jump": self.jump,
                **({"not_isolated": self.why_not_isolated} if self.why_not_isolated else {})}


@dataclass
class DiffReport:
    """What ``trtc diff`` found: the ``reference`` and ``candidate`` graphs (directory, precision, file), the
    ``data`` it ran on and how many ``samples``, the ONNX Runtime ``provider``, every layer in graph order, the
    graph ``outputs``, the ``jump`` layer, and the engines' outputs where ``--engines`` compared them."""

    reference: dict[str, str]
    candidate: dict[str, str]
    data: str
    samples: int
    provider: str
    layers: list[LayerDiff]
    outputs: dict[str, Errors]
    seconds: float
    jump: str | None = None
    engines: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)

    def ranked(self, sort: str = "isolated") -> list[LayerDiff]:
        """The layers worst first by their ``sort`` error (relative error; layers without one last)."""
        if sort not in SORTS:
            raise InputError(f"--sort {sort}: use one of {', '.join(SORTS)}")

        def key(row: LayerDiff) -> tuple[int, float, int]:
            errors = row.isolated if sort == "isolated" else row.accumulated
            if errors is None:
                return (1, 0.0, row.layer.depth)
            return (0, -errors.relative if not math.isnan(errors.relative) else 0.0, row.layer.depth)

        return sorted(self.layers, key=key)

    def to_json(self, sort: str = "isolated") -> dict[str, Any]:
        return {"reference": self.reference, "candidate": self.candidate, "data": self.data, "samples": self.samples,
                "provider": self.provider, "seconds": round(self.seconds, 2), "sort": sort, "jump": self.jump,
                "outputs": {name: e.to_json() for name, e in self.outputs.items()},
                "layers": [row.to_json() for row in self.ranked(sort)],
                **({"engines": self.engines} if self.engines is not None else {}), "notes": self.notes}


# --- running the comparison -----------------------------------------------------------------------------------------

def compare_graphs(reference: Path, candidate: Path, batches: Iterable[dict[str, np.ndarray]],
                   providers: list[str] | None = None, budget_bytes: int = defaults.CALIB_MEMORY_BUDGET,
                   ) -> tuple[ComparisonModel, dict[tuple[str, str], dict[str, float]], int, str]:
    """Run both graphs on ``batches``: (the comparison model's layers, the summed ``STATS`` of every comparison by
    (name, kind), samples run, provider). ``providers``: ``checking_providers()`` by default (CUDA where present);
    on the CPU FP16 runs as its rounding emulation, as the gate runs it."""
    providers = providers or checking_providers()
    _return_freed_memory()
    compared = comparison_model(load_onnx_by_reference(reference), load_onnx_by_reference(candidate),
                                emulate_fp16=providers[0] == "CPUExecutionProvider")
    with TemporaryOnnxFile(compared.model, prefix="trtc-diff-") as path:
        # ONNX Runtime reads the file; the proto was the last holder of its memory (protobuf frees a message's
        # arena only with the message itself, not on Clear), so its FP32-emulated weights go before the session loads
        compared.model = onnx.ModelProto()
        gc.collect()  # the builder's closures and records hold the graph in reference cycles
        runner = check_runner("onnxruntime", str(path), providers, memory_arena=False,
                              in_node_order=True)
        runner.activate()
    sums = {(c.name, c.kind): dict.fromkeys(STATS, 0.0) for c in compared.comparisons}
    counts = [name for c in compared.comparisons for stat, name in zip(STATS, c.outputs) if stat.endswith("count")]
    samples = 0
    expected = getattr(batches, "samples", 0)  # a CalibrationData knows its count once scanned
    try:
        with progress(f"comparing {len(compared.layers)} layers", int(expected) if expected else 0) as advance:
            for index, batch in enumerate(batches):
                for count, outs in _sliced(runner, batch, budget_bytes, f"diff, batch {index}", counts):
                    for comparison in compared.comparisons:
                        total = sums[(comparison.name, comparison.kind)]
                        for stat, name in zip(STATS, comparison.outputs):
                            value = float(outs[name])
                            total[stat] = max(total[stat], value) if stat == "max_abs" else total[stat] + value
                    advance(count)
                samples += leading_samples(batch) or 1
    finally:
        provider = str(getattr(runner, "provider", "")) or providers[0]
        runner.release()
    if not samples:
        raise InputError("the data holds no samples; pass --data with at least one")
    return compared, sums, samples, provider


# glibc's malloc raises its mmap threshold to the size of each block freed, up to 32 MiB: after the first run the
# tensors come from the heap, which cannot give back what is freed between long-lived blocks. The comparison's run
# frees thousands of tensors as it goes; on a ViT-B/16 the heap then held 0.8 GiB a sample of memory that was free.
_MMAP_THRESHOLD = 64 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _return_freed_memory() -> None:
    """Blocks of 64 KiB and more straight from the kernel and back to it when freed (glibc only; elsewhere
    nothing). Process-wide and for the rest of the process: what large allocations did before glibc's dynamic
    threshold moved."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return
    if mallopt is not None and platform.libc_ver()[0] == "glibc":
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def _sliced(runner: Runner, batch: dict[str, np.ndarray], budget_bytes: int, step: str, counts: list[str],
            ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """``runner`` on ``batch`` in slices of samples whose compared tensors (their counts: what one run holds of
    them at most) stay under ``budget_bytes``: (samples, outputs) per slice. The first slice is one sample, which
    measures them. A batch whose inputs share no leading dimension, or a fixed-batch model, runs whole."""
    size = leading_samples(batch) if takes_any_batch(runner) else 0
    if size <= 1:
        mark_step(step)
        yield max(1, size), runner.infer(batch)
        return
    start, width = 0, 1
    while start < size:
        stop = min(size, start + width)
        mark_step(f"{step}, samples {start}-{stop - 1}")
        outs = runner.infer({k: v[start:stop] for k, v in batch.items()})
        if start == 0:
            per_sample = 4 * sum(int(outs[name]) for name in counts)
            width = max(1, budget_bytes // max(1, per_sample))
        yield stop - start, outs
        start = stop


# --- a build directory ----------------------------------------------------------------------------------------------

def kept_layers(directory: Path, precision: str) -> dict[str, str]:
    """Why each layer of ``precision``'s graph stayed out of it, from ``report/accuracy.json``: the gate's
    decisions first, then the data-driven FP32 keeps (FP16 range), then where Q/DQ placement left it out."""
    path = directory / "report" / "accuracy.json"
    try:
        report = (read_json(path) if path.is_file() else {}).get(precision) or {}
    except (OSError, ValueError, AttributeError):
        return {}
    kept: dict[str, str] = {}
    for layer, why in ((report.get("qdq") or {}).get("skipped_nodes") or {}).items():
        kept[layer] = f"not quantized: {why}"
    for layer, why in ((report.get("node_precisions") or {}).get("fp32") or {}).items():
        kept[layer] = f"kept in FP32: {why}"
    for layer, why in (report.get("kept_in_fp32") or {}).items():
        kept[layer] = str(why)
    return kept


def reduced_precision(directory: Path, manifest: Manifest, precision: str | None) -> str:
    """``precision``, else the build's last reduced precision; InputError when the build has none."""
    if precision is None:
        precision = manifest.precision if manifest.precision in REDUCED_PRECISIONS else next(
            (p for p in manifest.onnx if p in REDUCED_PRECISIONS), None)
        if precision is None:
            raise InputError(f"{directory} holds only the FP32 graph: calibrate it first (`trtc calibrate "
                             f"{directory} --int8 ...`), or give a second build directory to compare with")
    manifest.onnx_record(directory, precision)
    return precision


def diff_batches(directory: Path, manifest: Manifest, data: Path | None, samples: int,
                 batch_size: int = defaults.CALIB_BATCH) -> tuple[Any, str]:
    """The inputs of a diff: ``data``, else the build's evaluation data, else its calibration data (files that are
    still there): (the batches, what they are). InputError when there are none."""
    from calibration.data import calibration_data
    from compiler.bench.inputs import build_data

    what = f"--data {data}"
    if data is None:
        data, why = build_data(directory, manifest)
        if data is None:
            raise InputError(f"no data to compare on: {why}; pass --data FILE.npz (one array per input)")
        what = why
    batches = calibration_data(data, manifest.spec, batch_size=min(batch_size, samples), max_samples=samples)
    return batches, what


def _report(compared: ComparisonModel, sums: dict[tuple[str, str], dict[str, float]], kept: dict[str, str],
            ) -> tuple[list[LayerDiff], dict[str, Errors], str | None]:
    accumulated = {layer.name: Errors.of(sums[(layer.name, "accumulated")]) for layer in compared.layers}
    rises = {}
    for layer in compared.layers:
        before = max((accumulated[u].relative for u in layer.upstream), default=0.0)
        rises[layer.name] = accumulated[layer.name].relative - before
    finite = [r for r in rises.values() if math.isfinite(r)]
    top = max(finite, default=0.0)
    jump = next((layer.name for layer in compared.layers
                 if top > 0 and (not math.isfinite(rises[layer.name]) or rises[layer.name] >= JUMP_SHARE * top)),
                None)
    rows = []
    for layer in compared.layers:
        isolated = sums.get((layer.name, "isolated"))
        rows.append(LayerDiff(layer, accumulated[layer.name], Errors.of(isolated) if isolated else None,
                              kept.get(layer.name), rises[layer.name], layer.name == jump,
                              compared.not_isolated.get(layer.name)))
    outputs = {name: Errors.of(s) for (name, kind), s in sums.items() if kind == "output"}
    return rows, outputs, jump


def diff_directory(directory: Path, precision: str | None = None, data: Path | None = None,
                   samples: int = defaults.DIFF_SAMPLES, providers: list[str] | None = None,
                   budget_bytes: int = defaults.CALIB_MEMORY_BUDGET) -> DiffReport:
    """``trtc diff DIR``: the FP32 graph of ``directory`` against its ``precision`` graph (default: its last
    reduced precision), layer by layer, on at most ``samples`` samples. Both graphs are read only after their
    sha256 matches the manifest's."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    precision = reduced_precision(directory, manifest, precision)
    reference, candidate = manifest.onnx_for(directory, "fp32"), manifest.onnx_for(directory, precision)
    batches, what = diff_batches(directory, manifest, data, samples)
    start = time.perf_counter()
    compared, sums, count, provider = compare_graphs(reference, candidate, batches, providers, budget_bytes)
    rows, outputs, jump = _report(compared, sums, kept_layers(directory, precision))
    return DiffReport({"directory": str(directory), "precision": "fp32", "file": reference.name},
                      {"directory": str(directory), "precision": precision, "file": candidate.name},
                      what, count, provider, rows, outputs, time.perf_counter() - start, jump)


def diff_directories(first: Path, second: Path, precision: str | None = None, data: Path | None = None,
                     samples: int = defaults.DIFF_SAMPLES, providers: list[str] | None = None,
                     budget_bytes: int = defaults.CALIB_MEMORY_BUDGET) -> DiffReport:
    """``trtc diff A B``: B's precision graph against A's (``precision``, default each build's last reduced
    precision, else FP32), on A's data unless ``data``. InputError when they hold different models."""
    first, second = Path(first), Path(second)
    a, b = read_manifest(first), read_manifest(second)
    same_source = a.source is not None and b.source is not None and a.source.sha256 and \
        a.source.sha256 == b.source.sha256
    same_fp32 = "fp32" in a.onnx and "fp32" in b.onnx and a.onnx["fp32"].sha256 == b.onnx["fp32"].sha256
    if not (same_source or same_fp32) or a.inputs != b.inputs:
        raise InputError(f"{first} and {second} hold builds of different models (source and FP32 ONNX differ); "
                         "trtc diff A B compares two builds of one model")

    def graph(directory: Path, manifest: Manifest) -> tuple[str, Path]:
        chosen = precision or (manifest.precision if manifest.precision in manifest.onnx else "fp32")
        return chosen, manifest.onnx_for(directory, chosen)

    (p_a, reference), (p_b, candidate) = graph(first, a), graph(second, b)
    batches, what = diff_batches(first, a, data, samples)
    start = time.perf_counter()
    compared, sums, count, provider = compare_graphs(reference, candidate, batches, providers, budget_bytes)
    rows, outputs, jump = _report(compared, sums, kept_layers(second, p_b))
    return DiffReport({"directory": str(first), "precision": p_a, "file": reference.name},
                      {"directory": str(second), "precision": p_b, "file": candidate.name},
                      what, count, provider, rows, outputs, time.perf_counter() - start, jump)
