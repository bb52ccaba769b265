"""INT8, FP8, INT4 weight-only and FP16 graphs from a directory's folded FP32 ONNX, proven with ONNX Runtime.

``calibrated_into`` does the work inside a staging folder (``trtc build`` chains it after
export); ``calibrate_directory`` is ``trtc calibrate DIR``: it stages, runs, and commits the
results into DIR with the manifest last. A model that misses the accuracy gate leaves
``report/accuracy.json`` (one entry per precision) and ``calibration.json`` but no
reduced-precision ONNX.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import onnx

from calibration.accuracy import AccuracyResult, Evaluator, GateOutcome, gate_with_fallback
from calibration.data import RANDOM, CalibrationData, calibration_data
from calibration.fp16 import Fp16Report, float_tensors, fp16_model_from, int8_fp16_model_from
from calibration.fp16_policy import FP16_MIN_NORMAL, FP16_TINY, Fp16Policy
from calibration.int4 import int4_stage
from calibration.load_check import LoadCheckBeside, check_serving_load
from calibration.node_precisions import node_precisions
from calibration.observe import collect_histograms, collect_max_abs
from calibration.qdq import PLACEMENT, QdqPolicy, QdqReport, qdq_model_from, quantizable_nodes, tensors_to_calibrate
from calibration.weights import raise_opset
from compiler.core.capabilities import checking_providers
from compiler.core.errors import AccuracyGateError, CalibrationError
from compiler.core.files import atomic_write_json, directory_transaction, read_json, sha256_file
from compiler.core.manifest import (
    MANIFEST,
    CalibrationRecord,
    FileRecord,
    Manifest,
    now,
    read_manifest,
    verified_onnx,
    write_manifest,
)
from compiler.core.onnx_io import load_onnx_by_reference, onnx_files, save_onnx, warm_checking_providers
from compiler.core.progress import progress, stage_timer
from compiler.core.settings import MIN_COMPUTE_CAPABILITY, CalibrationSettings
from compiler.core.specs import ModelSpec
from compiler.core.worker import Worker, in_worker, isolated, mark

__all__ = ["CalibrationSettings", "CalibrationOutcome", "calibrated_into", "calibration_started", "calibration_worker",
           "calibrate_directory"]

log = logging.getLogger(__name__)

ONNX_NAMES = {"int8": "model.int8.onnx", "fp16": "model.fp16.onnx", "fp8": "model.fp8.onnx", "int4": "model.int4.onnx"}
CALIBRATION_JSON = "calibration.json"
# the activation ranges of each Q/DQ precision, reused while model, data and method stay the same
CALIBRATION_FILES = {"int8": CALIBRATION_JSON, "fp8": "calibration.fp8.json"}
FP8_OPSET = 19  # QuantizeLinear/DequantizeLinear with FP8 types
ACCURACY_JSON = "report/accuracy.json"
ALL_SAMPLES = 1 << 62  # the gate evaluates every sample of --eval-data; --calib-samples bounds calibration only


@dataclass
class CalibrationOutcome:
    """What ``calibrated_into`` made: the record the manifest gets (``Manifest.with_calibration``) when the model
    passed the accuracy gate, else None and the message saying why not."""

    record: CalibrationRecord | None
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.record is not None


def calibrate_directory(directory: Path, settings: CalibrationSettings) -> Manifest:
    """``trtc calibrate DIR``: add model.int8.onnx or model.fp16.onnx to an export directory."""
    manifest = read_manifest(directory)
    with directory_transaction(directory, f"trtc calibrate --{settings.precision}") as transaction:
        stage = transaction.stage
        for name in (*CALIBRATION_FILES.values(), ACCURACY_JSON):  # calibration.json is reused when nothing changed
            if (directory / name).is_file():
                (stage / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(directory / name, stage / name)
        record = manifest.onnx.get("fp32")
        fp32 = verified_onnx(directory, record, "fp32")
        digest = record.file_sha256.get(record.file) if record is not None else None  # verified just now
        with stage_timer(f"{settings.precision.upper()} calibration"):
            outcome = calibrated_into(stage, fp32, manifest.spec, settings, fp32_sha256=digest)
        if outcome.record is not None:
            manifest = manifest.with_calibration(outcome.record)
            write_manifest(stage / MANIFEST, manifest)
        elif settings.precision in manifest.onnx and settings.precision in CALIBRATION_FILES \
                and (stage / CALIBRATION_FILES[settings.precision]).is_file():
            # calibration.json must keep describing the model.int8.onnx that is there; the failed attempt's
            # ranges go beside its report
            failed = CALIBRATION_FILES[settings.precision].replace(".json", ".failed.json")
            os.replace(stage / CALIBRATION_FILES[settings.precision], stage / "report" / failed)
        # a failed gate commits its report too, then raises below
    if not outcome.passed:
        raise AccuracyGateError(f"{outcome.message}; see {directory / ACCURACY_JSON}")
    return manifest


def calibrated_into(stage: Path, fp32_path: Path, spec: ModelSpec, settings: CalibrationSettings,
                    worker: Worker | None = None, fp32_sha256: str | None = None) -> CalibrationOutcome:
    """Write the reduced-precision ONNX, calibration.json and report/accuracy.json into ``stage``.

    ``stage`` may already hold a ``calibration.json`` to reuse (``--calib-cache`` copies it there). Runs in
    a worker process (``compiler.core.worker``): a native crash of ONNX Runtime becomes ``WorkerCrashed`` naming
    the stage, the model and the batch, and the memory of the ONNX Runtime sessions goes back when it ends.
    ``worker``: one started ahead (``calibration_worker``), else a new one. ``fp32_sha256``: the digest of
    ``fp32_path``'s own file where the caller has it (its manifest record), else it is computed.
    """
    return calibration_started(stage, fp32_path, spec, settings, worker, fp32_sha256)()


def calibration_started(stage: Path, fp32_path: Path, spec: ModelSpec, settings: CalibrationSettings,
                        worker: Worker | None = None, fp32_sha256: str | None = None,
                        ) -> Callable[[], CalibrationOutcome]:
    """``calibrated_into`` begun: with ``worker`` it runs from now on, beside whatever the caller does until it
    calls the function returned, which gives the outcome (or raises); without one the work happens in that call
    (in a worker of its own, or in this process under TRTC_IN_PROCESS=1). Closing ``worker`` before that call
    abandons the calibration."""
    what = f"{settings.precision.upper()} calibration"
    args = (stage, fp32_path, spec, settings, fp32_sha256)
    if worker is not None:
        worker.start(what, _calibrated_into, *args)
        return worker.result  # type: ignore[no-any-return]
    if isolated():
        return partial(in_worker, what, _calibrated_into, *args)
    return partial(_calibrated_into, *args)


def calibration_worker() -> Worker | None:
    """A worker for ``calibrated_into`` started now, so that its start (interpreter, imports, CUDA and ONNX
    Runtime's provider libraries: seconds) overlaps the export; None where stages run in this process."""
    return Worker(warm=_warm_worker) if isolated() else None


def _warm_worker() -> None:
    """What a calibration worker runs before its call: this module's imports (unpickling this function imports
    it) and the providers of its ONNX Runtime runs (``warm_checking_providers``)."""
    warm_checking_providers()


def _calibrated_into(stage: Path, fp32_path: Path, spec: ModelSpec, settings: CalibrationSettings,
                     fp32_sha256: str | None = None) -> CalibrationOutcome:
    start = time.perf_counter()
    model = load_onnx_by_reference(fp32_path)  # weights stay in their file: passes read what they need
    data = _open_data(settings.data, settings, spec) if (settings.data or settings.loader) else None
    eval_data = _open_data(settings.eval_data, settings, spec, for_eval=True) if settings.eval_data else data
    model_sha = fp32_sha256 or sha256_file(fp32_path)
    with LoadCheckBeside(partial(_one_sample, eval_data or data, spec), ONNX_NAMES[settings.precision]) as load_check:
        result, details = _reduced(stage, model, fp32_path, model_sha, data, eval_data, settings, load_check)
        return _written(stage, fp32_path, model, settings, start, data, eval_data, result, details, load_check)


def _reduced(stage: Path, model: onnx.ModelProto, fp32_path: Path, model_sha: str, data: CalibrationData | None,
             eval_data: CalibrationData | None, settings: CalibrationSettings, load_check: LoadCheckBeside,
             ) -> tuple[GateOutcome | None, dict[str, Any]]:
    """The reduced-precision model of ``settings.precision``, gated where there is evaluation data."""
    if settings.precision in CALIBRATION_FILES:
        return _qdq(stage, model, fp32_path, model_sha, data, eval_data, settings, load_check)
    if settings.precision == "int4":
        evaluator = _evaluator(fp32_path, eval_data, settings)
        return int4_stage(model, fp32_path, data, evaluator, settings)
    return _fp16(model, fp32_path, data, eval_data, settings, load_check)


def _written(stage: Path, fp32_path: Path, model: onnx.ModelProto, settings: CalibrationSettings, start: float,
             data: CalibrationData | None, eval_data: CalibrationData | None, result: GateOutcome | None,
             details: dict[str, Any], load_check: LoadCheckBeside) -> CalibrationOutcome:
    """The report, and the precision file where the gate passed (or did not run), checked to load as served."""
    ungated_model = details.pop("_model")
    report = {"precision": settings.precision, "created": now(), "seconds": round(time.perf_counter() - start, 2),
              "calibration_data": data.to_dict() if data else None,
              "eval_data": eval_data.to_dict() if eval_data else None,
              "gate": asdict(settings.gate), **details}
    if result is None:
        report["accuracy"] = None
        report["note"] = "no evaluation data: the accuracy gate did not run"
        log.warning("no evaluation data: the %s accuracy gate did not run", settings.precision)
    else:
        report["accuracy"] = result.result.to_dict()
        report["kept_in_fp32"] = result.kept  # the key predates the FP16 remainder: see kept_as
        report["kept_as"] = _kept_as(settings).lower()
        report["gate_history"] = result.history
        report["ranking_seconds"] = result.ranking_seconds
    reports = _earlier_reports(stage / ACCURACY_JSON)
    atomic_write_json(stage / ACCURACY_JSON, {**reports, settings.precision: report})
    if result is not None and result.result.nothing_scored:
        return CalibrationOutcome(None, f"the {settings.precision} accuracy gate cannot pass: "
                                        f"{result.result.summary()}")
    if result is not None and not result.result.passed:
        # the caller names where the report is
        message = (f"the {settings.precision} model misses the accuracy gate ({result.result.summary()}) even with "
                   f"{len(result.kept)} layer(s) kept in {_kept_as(settings)}; FP32 artifacts are kept; "
                   + _advice(model, result.result, settings))
        return CalibrationOutcome(None, message)
    out = stage / ONNX_NAMES[settings.precision]
    final = result.model if result is not None else ungated_model
    save_onnx(final, out)
    proven = load_check.proven(final)
    if result is not None and not result.result.fp16_emulated:
        proven.add(result.result.provider)
    check_serving_load(out, load_check.feed(), proven)
    onnx_record = FileRecord.for_onnx(stage, out)
    if settings.precision in MIN_COMPUTE_CAPABILITY:  # what engines built from this graph need
        needed = ".".join(map(str, MIN_COMPUTE_CAPABILITY[settings.precision][0]))
        onnx_record = replace(onnx_record, extra={**onnx_record.extra, "requires_compute_capability": needed})
    record = CalibrationRecord(
        precision=settings.precision, onnx=onnx_record,
        accuracy={"metric": report["accuracy"]["metric"] if report["accuracy"] else None,
                  "summary": result.result.summary() if result else "gate not run",
                  "kept_in_fp32": sorted(result.kept) if result else [],
                  "provider": result.result.provider if result else None},
        # the data behind each precision (FP16 too): what it was, how many samples, whether it was random
        data={"calibration": report["calibration_data"], "eval": report["eval_data"]})
    if settings.precision in CALIBRATION_FILES:  # int8's section is "calibration" (it predates fp8's)
        section = {"calibration_data": report["calibration_data"], **details["calibration"],
                   "remainder": details["remainder"], "node_precisions": report["node_precisions"]["counts"]}
        if settings.precision == "int8":
            return CalibrationOutcome(replace(record, calibration=section))
        return CalibrationOutcome(replace(record, fp8=section))
    if settings.precision == "int4":
        fp32_bytes = sum(f.stat().st_size for f in onnx_files(fp32_path))
        size = onnx_record.bytes or 0
        log.info("INT4 model: %.1f MB, %.2f of the FP32 model's %.1f MB", size / 1e6, size / max(1, fp32_bytes),
                 fp32_bytes / 1e6)
        return CalibrationOutcome(replace(record, int4={
            **details["int4"], "bytes": size, "fp32_bytes": fp32_bytes,
            "size_ratio": round(size / fp32_bytes, 4) if fp32_bytes else None,
            "kept_in_fp16": sorted(result.kept) if result is not None else []}))
    return CalibrationOutcome(replace(record, fp16={
        "fp32_nodes": len(details["fp16"]["fp32_nodes"]), "casts": details["fp16"]["casts_inserted"],
        "range_provider": details["fp16_range_provider"]}))


def _advice(model: onnx.ModelProto, result: AccuracyResult, settings: CalibrationSettings) -> str:
    """What to try after a failed gate: for an output whose FP32 values all lie below FP16's smallest normal (an
    underflow, where the graph computes in FP16), that output's layer in FP32; else more data or fallback."""
    producers = {out: node.name for node in model.graph.node for out in node.output}
    fp16 = settings.precision == "fp16" or not settings.fp32_rest
    for name, entry in result.per_output.items():
        top = entry.get("fp32_max_abs")
        cosine = entry.get("cosine_mean")
        if fp16 and top is not None and 0 < top < FP16_MIN_NORMAL \
                and not (cosine is not None and cosine >= settings.gate.min_cosine):
            return (f"output {name}'s FP32 values are at most {top:.2g}, below FP16's smallest normal "
                    f"{FP16_MIN_NORMAL:.2g} (smallest subnormal {FP16_TINY:.2g}): FP16 rounds them to zero or a few "
                    f"bits; keep the layer that produces it in FP32 (--keep-fp32 {producers.get(name, name)}), or "
                    "pass --calib-data so that calibration measures the ranges and keeps such layers itself")
    if settings.precision == "fp16":
        return "try more calibration data, a larger --max-fallback, or --keep-fp32 for the layers it ranks worst"
    return "try more calibration data, another --calib-method, or a larger --max-fallback"


def _one_sample(data: CalibrationData | None, spec: ModelSpec) -> dict[str, Any]:
    """The first sample of ``data`` as a batch of one (real values: an id input may refuse zeros), else the spec's
    seeded example inputs."""
    if data is not None:
        for batch in data.batches():
            return {k: v[:1] if getattr(v, "ndim", 0) else v for k, v in batch.items() if k in spec.input_names}
    return spec.example_feed(1)


def _earlier_reports(path: Path) -> dict[str, Any]:
    """The other precisions' entries of an existing report/accuracy.json; a damaged one is replaced, with a note."""
    if not path.is_file():
        return {}
    try:
        reports = read_json(path)
    except ValueError as err:
        log.warning("%s is damaged (%s); writing a new one", path.name, err)
        return {}
    return reports if isinstance(reports, dict) else {}


def _open_data(source: str | None, settings: CalibrationSettings, spec: ModelSpec,
               for_eval: bool = False) -> CalibrationData:
    samples = ALL_SAMPLES if for_eval and source != RANDOM else settings.samples
    return calibration_data(source, spec, loader=None if for_eval else settings.loader,
                            batch_size=settings.batch_size, max_samples=samples, image=settings.image,
                            labels=settings.labels)


def _evaluator(model: Path, eval_data: CalibrationData | None, settings: CalibrationSettings,
               ) -> Evaluator | None:
    if eval_data is None:
        return None
    # files are read again on each evaluation, so memory does not grow with the evaluation set; a loader
    # function may shuffle or augment, so its batches are held to keep them paired with the FP32 outputs
    batches = eval_data if eval_data.repeatable else list(eval_data.batches())
    mark(f"{settings.precision.upper()} accuracy gate: FP32 reference outputs")
    return Evaluator.from_model(str(model), batches, eval_data.labels, settings.gate, providers=checking_providers(),
                                budget_bytes=settings.memory_budget)


def _evaluator_beside(pool: ThreadPoolExecutor, model: Path, eval_data: CalibrationData | None,
                      settings: CalibrationSettings) -> Callable[[], Evaluator | None]:
    """A function returning ``_evaluator(model, eval_data, settings)``, whose FP32 reference outputs are computed
    from now on in ``pool``'s thread, beside the calibration pass, where ONNX Runtime runs on CUDA and the data
    can be read twice at once (files, random data; ONNX Runtime and NumPy release the GIL): on an H200 the
    reference of a ViT-B/16 took 3 s after the pass. Elsewhere it is computed when called: on the CPU both passes
    would share the same cores and hold their sessions' memory at once, and a loader function may not be
    reentrant."""
    if not _reference_beside(eval_data):
        return lambda: _evaluator(model, eval_data, settings)
    return pool.submit(_evaluator, model, eval_data, settings).result


def _reference_beside(eval_data: CalibrationData | None) -> bool:
    """Whether the gate's FP32 reference runs beside the calibration pass (``_evaluator_beside``)."""
    return eval_data is not None and eval_data.repeatable and checking_providers()[0] == "CUDAExecutionProvider"


def _calibrated_ranges(model: onnx.ModelProto, fp32_path: Path, model_sha: str, data: CalibrationData,
                       settings: CalibrationSettings, tensors: list[str]) -> dict[str, Any]:
    """The calibration record (what calibration.json holds) from one pass over ``data``: the histograms' amax of
    ``tensors`` and, for an FP16 remainder, the max |x| of every float tensor (scalars reduced in-graph)."""
    what = settings.precision.upper()
    start = time.perf_counter()
    floats = [] if settings.fp32_rest else float_tensors(model)
    mark(f"{what} calibration: histograms of {len(tensors)} tensors and max |x| of {len(floats)} of the FP32 "
         "model")
    with progress(f"calibrating {len(tensors)} tensors", data.samples) as advance:
        stats = collect_histograms(fp32_path, tensors, data.batches(), progress=advance,
                                   providers=checking_providers(), budget_bytes=settings.memory_budget,
                                   max_abs_names=floats)
    amax = stats.amax(settings.method, settings.percentile)
    record = {"model_sha256": model_sha, "method": settings.method, "percentile": settings.percentile,
              "data": data.to_dict(), "seconds": round(time.perf_counter() - start, 2),
              "provider": checking_providers()[0], "binned_on": stats.binned_on,
              "excluded_values": stats.excluded, "infinite_values": stats.infinite,
              "amax": amax}
    if stats.max_abs is not None:
        record["max_abs"] = stats.max_abs
    log.info("calibrated %d tensors on %d samples in %.1f s (%s)", len(amax), data.samples, record["seconds"],
             settings.method)
    return record


def _qdq(stage: Path, model: onnx.ModelProto, fp32_path: Path, model_sha: str, data: CalibrationData | None,
         eval_data: CalibrationData | None, settings: CalibrationSettings, load_check: LoadCheckBeside,
         ) -> tuple[GateOutcome | None, dict[str, Any]]:
    """INT8 or FP8 (``settings.precision``) Q/DQ with the FP16 rest, calibrated, gated, with the fallback."""
    precision, what = settings.precision, settings.precision.upper()
    if precision == "fp8":
        model = raise_opset(model, FP8_OPSET)
    policy = QdqPolicy(precision=precision, quantize_attention_matmuls=settings.quantize_attention,
                       exclude_nodes=frozenset(settings.keep_fp32) & set(quantizable_nodes(model)),
                       exclude_op_types=frozenset(settings.keep_fp32) - set(quantizable_nodes(model)))
    tensors = tensors_to_calibrate(model, QdqPolicy(precision=precision,
                                                    quantize_attention_matmuls=settings.quantize_attention))
    cache_file = CALIBRATION_FILES[precision]
    cache = _usable_cache(stage / cache_file, model_sha, data, settings, tensors)
    if cache is None and data is None:
        raise CalibrationError(f"{what} needs calibration data: pass --calib-data PATH or --calib-loader, or "
                               f"--calib-cache with a {cache_file} from an earlier build")
    with ThreadPoolExecutor(1, thread_name_prefix="trtc-fp32-reference") as pool:
        reference = _evaluator_beside(pool, fp32_path, eval_data, settings)
        if cache is not None:
            log.info("reusing %s: %d tensors, calibrated on %s", cache_file, len(cache["amax"]),
                     cache["data"]["source"])
            record = cache
        else:
            assert data is not None
            record = _calibrated_ranges(model, fp32_path, model_sha, data, settings, tensors)
        evaluator = reference()
    amax = {k: float(v) for k, v in record["amax"].items()}
    policy = _without_infinite_inputs(model, policy, record.get("infinite_values") or {}, what)
    max_abs = None if settings.fp32_rest else _float_ranges(model, fp32_path, record, data, settings)
    atomic_write_json(stage / cache_file, record)
    fp16_policy = Fp16Policy(keep_fp32=frozenset(settings.keep_fp32))

    def reduced(excluded: frozenset[str]) -> tuple[onnx.ModelProto, QdqReport, Fp16Report | None]:
        """The model with ``excluded`` layers out of the Q/DQ precision, and what the Q/DQ and FP16 passes did."""
        mark(_candidate(what, excluded))
        p = QdqPolicy(precision=precision, quantize_attention_matmuls=policy.quantize_attention_matmuls,
                      exclude_nodes=policy.exclude_nodes | excluded, exclude_op_types=policy.exclude_op_types)
        qdq, qdq_report = qdq_model_from(model, amax, p)
        if settings.fp32_rest:
            return qdq, qdq_report, None
        combined, fp16_report = int8_fp16_model_from(qdq, fp16_policy, max_abs)
        return combined, qdq_report, fp16_report

    reports: dict[frozenset[str], tuple[QdqReport, Fp16Report | None]] = {}  # of every candidate the gate built

    def build(excluded: frozenset[str]) -> onnx.ModelProto:
        candidate, q, f = reduced(excluded)
        reports[excluded] = (q, f)
        return candidate

    qmodel, qreport, freport = reduced(frozenset())
    details: dict[str, Any] = {
        "qdq": qreport.to_dict(),
        "remainder": "fp32" if settings.fp32_rest else "fp16",
        "calibration": {"method": record["method"], "percentile": record["percentile"],
                        "samples": record["data"]["samples"], "data_sha256": record["data"]["sha256"],
                        "random_data": record["data"]["random"], "tensors": len(amax),
                        "reused_cache": cache is not None, "provider": record.get("provider")},
        "_model": qmodel,
    }
    details["node_precisions"] = _precisions(model, qreport.quantized_nodes, freport, precision)
    if evaluator is None:
        _log_precisions(details["node_precisions"], precision)
        return None, details
    # residual adds, pools and concats follow the layers around them, so only weighted layers are ranked
    op_types = {n.name: n.op_type for n in model.graph.node}
    candidates = [n for n in quantizable_nodes(model, policy) if PLACEMENT[op_types[n]].kind == "weighted"]
    gate_start = time.perf_counter()
    load_check.start(qmodel)
    with stage_timer(f"{what} accuracy gate"):
        outcome = gate_with_fallback(build, candidates, evaluator, what, initial=qmodel, reference=model,
                                     kept_as=_kept_as(settings))
    details["gate_seconds"] = round(time.perf_counter() - gate_start, 2)
    if outcome.kept:  # the gate's last candidate: its reports, not a second build of it
        qreport, freport = reports[frozenset(outcome.kept)]
        details["node_precisions"] = _precisions(model, qreport.quantized_nodes, freport, precision)
    _log_precisions(details["node_precisions"], precision)
    return outcome, details


def _without_infinite_inputs(model: onnx.ModelProto, policy: QdqPolicy, infinite: dict[str, int],
                             what: str) -> QdqPolicy:
    """``policy`` with the nodes that read a tensor holding the model's own infinities (calibration/masks.py) kept
    out of the Q/DQ precision: a quantized infinity becomes the largest finite level, which the mask downstream no
    longer removes."""
    if not infinite:
        return policy
    quantizable = set(quantizable_nodes(model, policy))
    held = sorted(n.name for n in model.graph.node if n.name in quantizable and not infinite.keys().isdisjoint(n.input))
    if not held:
        return policy
    log.info("kept %d node(s) out of %s: they read the model's own infinities (%s)", len(held), what,
             ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else ""))
    return replace(policy, exclude_nodes=policy.exclude_nodes | set(held))


def _precisions(model: onnx.ModelProto, quantized: list[str], report: Fp16Report | None, precision: str,
                ) -> dict[str, Any]:
    """``node_precisions`` with the quantized nodes under ``precision`` (int8 or fp8)."""
    counts = node_precisions(model, quantized, report)
    if precision != "int8":
        counts["counts"] = {precision if k == "int8" else k: v for k, v in counts["counts"].items()}
        counts[precision] = counts.pop("int8")
    return counts


def _kept_as(settings: CalibrationSettings) -> str:
    """The precision of a layer the gate keeps out of the reduced one: FP16 where the rest is FP16."""
    return "FP16" if settings.precision in ("int8", "fp8", "int4") and not settings.fp32_rest else "FP32"


def _log_precisions(precisions: dict[str, Any], precision: str = "int8") -> None:
    counts = precisions["counts"]
    what = precision.upper()
    log.info("%s model: %d nodes in %s, %d in FP16, %d in FP32", what, counts[precision], what, counts["fp16"],
             counts["fp32"])
    if counts["fp16"]:  # with an FP32 remainder every other node is FP32: no list
        for name, why in precisions["fp32"].items():
            log.info("kept %s in FP32: %s", name, why)


def _float_ranges(model: onnx.ModelProto, fp32_path: Path, record: dict[str, Any], data: CalibrationData | None,
                  settings: CalibrationSettings,
                  ) -> dict[str, float] | None:
    """max |x| of every float tensor, for the FP16 remainder's range rule; stored in calibration.json.

    Calibration measures it in its own pass (``record["max_abs"]``); only a reused calibration.json that
    lacks it (written before that) costs a pass over the data here.
    """
    if isinstance(record.get("max_abs"), dict):
        return {k: float(v) for k, v in record["max_abs"].items()}
    if data is None:
        log.warning("no calibration data and no max |x| in the calibration cache: the FP16 remainder uses the "
                    "type rules only (no overflow check); pass --calib-data to measure ranges")
        return None
    max_abs = collect_max_abs(fp32_path, float_tensors(model), data.batches(), providers=checking_providers(),
                              budget_bytes=settings.memory_budget)
    record["max_abs"] = max_abs
    log.info("measured max |x| of %d tensors for the FP16 remainder", len(max_abs))
    return max_abs


def _usable_cache(path: Path, model_sha: str, data: CalibrationData | None, settings: CalibrationSettings,
                  tensors: list[str]) -> dict[str, Any] | None:
    source = settings.calib_cache if settings.calib_cache else (path if path.is_file() else None)
    if source is None or not Path(source).is_file():
        if settings.calib_cache:
            raise CalibrationError(f"--calib-cache {settings.calib_cache}: no such file")
        return None
    try:
        cache = read_json(source)
    except ValueError as err:
        raise CalibrationError(f"{source}: not a calibration.json ({err})") from err
    if not isinstance(cache, dict) or not isinstance(cache.get("amax"), dict) \
            or not isinstance(cache.get("data"), dict):
        raise CalibrationError(f"{source}: not a calibration.json (no amax and data records); pass one that "
                               "trtc calibrate wrote, or delete it to calibrate again")
    reasons = []
    if cache.get("model_sha256") != model_sha:
        reasons.append("the FP32 model changed")
    if (cache.get("method"), cache.get("percentile")) != (settings.method, settings.percentile):
        reasons.append("the method or percentile changed")
    if data is not None and cache.get("data", {}).get("sha256") != data.fingerprint:
        reasons.append("the calibration data changed")
    missing = [t for t in tensors if t not in cache["amax"]]
    if missing:  # e.g. calibrated without --quantize-attention, now with it
        reasons.append(f"it has no amax for {len(missing)} tensor(s) to quantize now ({missing[0]}, ...)")
    if reasons:
        if settings.calib_cache:
            log.warning("not reusing %s: %s", source, "; ".join(reasons))
        return None
    return cache


def _fp16(model: onnx.ModelProto, fp32_path: Path, data: CalibrationData | None, eval_data: CalibrationData | None,
          settings: CalibrationSettings, load_check: LoadCheckBeside) -> tuple[GateOutcome | None, dict[str, Any]]:
    max_abs: dict[str, float] | None = None
    with ThreadPoolExecutor(1, thread_name_prefix="trtc-fp32-reference") as pool:
        reference = _evaluator_beside(pool, fp32_path, eval_data, settings)
        if data is not None:
            names = float_tensors(model)
            mark(f"FP16 range pass: max |x| of {len(names)} tensors of the FP32 model")
            with progress(f"FP16 range of {len(names)} tensors", data.samples) as advance:
                max_abs = collect_max_abs(fp32_path, names, data.batches(), providers=checking_providers(),
                                          progress=advance, budget_bytes=settings.memory_budget)
            log.info("measured max |x| of %d tensors on %d samples", len(max_abs), data.samples)
        else:
            log.warning("no calibration data: FP16 conversion uses the type rules only (no overflow check)")
        evaluator = reference()
    base = Fp16Policy(keep_fp32=frozenset(settings.keep_fp32))

    def build(excluded: frozenset[str]) -> onnx.ModelProto:
        mark(_candidate("FP16", excluded))
        return fp16_model_from(model, Fp16Policy(keep_fp32=base.keep_fp32 | excluded), max_abs)[0]

    fmodel, report = fp16_model_from(model, base, max_abs)
    log.info("FP16 model: %d nodes in FP16, %d kept in FP32, %d Casts", report.fp16_nodes, len(report.fp32_nodes),
             report.casts_inserted)
    for name, why in report.fp32_nodes.items():
        log.info("kept %s in FP32: %s", name, why)
    details: dict[str, Any] = {"fp16": report.to_dict(), "_model": fmodel,
                               "fp16_range_provider": checking_providers()[0] if data is not None else None}
    if evaluator is None:
        return None, details
    candidates = [n.name for n in model.graph.node if n.name not in report.fp32_nodes
                  and n.op_type in _FP16_CANDIDATE_OPS]
    gate_start = time.perf_counter()
    load_check.start(fmodel)
    with stage_timer("FP16 accuracy gate"):
        outcome = gate_with_fallback(build, candidates, evaluator, "FP16", initial=fmodel, reference=model)
    details["gate_seconds"] = round(time.perf_counter() - gate_start, 2)
    return outcome, details


_FP16_CANDIDATE_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Softmax", "LayerNormalization",
                                 "Add", "Mul", "Div", "Sub", "Gelu", "ReduceMean", "Sqrt", "Erf", "Tanh", "Sigmoid"})


def _candidate(what: str, excluded: frozenset[str]) -> str:
    """The crash-report name of a gate candidate: the precision and the layers it keeps in FP32."""
    if not excluded:
        return f"{what} accuracy gate: the {what} model"
    names = sorted(excluded)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{what} accuracy gate: the {what} model with {shown} kept in FP32"
