"""``trtc build``: export, calibrate and build engines into one directory, atomically.

Everything is written into a staging folder inside the output directory and moved into
place only at the end, manifest last:
  * the accuracy gate fails -> nothing of the build replaces the previous one; the failed
    attempt's report, calibration and FP32 ONNX go to ``DIR/failed/`` for inspection (exit 3);
  * TensorRT is not installed -> every artifact but the engines is committed, then exit 4
    (``--engine none`` makes that the intended outcome, exit 0);
  * any other error or a kill -> the previous build stays as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from compiler.backends.tensorrt.build import build_engine_files
from compiler.backends.tensorrt.environment import environment
from compiler.backends.tensorrt.versions import NOT_INSTALLED, require_tensorrt
from compiler.core.capabilities import tensorrt_version
from compiler.core.errors import AccuracyGateError, InputError, TensorRTNotInstalled
from compiler.core.files import directory_transaction, settle_modes
from compiler.core.manifest import MANIFEST, Manifest, refuse_foreign_directory, write_manifest
from compiler.core.progress import recording_stages, stage_timer
from compiler.core.settings import MIN_COMPUTE_CAPABILITY, BuildSettings, ExportSettings
from compiler.core.specs import BATCH_DIM, ModelSpec
from compiler.frontend.verify import FeedSource
from compiler.pipeline.export import (
    FP32_ONNX,
    export_step,
    model_to_export,
    refuse_oversized_buckets,
    spec_is_complete,
    write_timing,
)

__all__ = ["build_directory", "refuse_unsupported_precision", "FAILED_DIR"]

log = logging.getLogger(__name__)

FAILED_DIR = "failed"


def build_directory(export: ExportSettings, calibration: Any | None, build: BuildSettings,
                    command: str = "trtc build") -> Manifest:
    """Run the whole chain; returns the manifest written. ``calibration`` is a CalibrationSettings or None (FP32)."""
    from calibration.calibrate import ACCURACY_JSON, CALIBRATION_FILES, calibration_started, calibration_worker

    start = time.perf_counter()
    out = export.out
    with recording_stages() as times, contextlib.ExitStack() as workers:
        with stage_timer("checks before export"):
            # before the export and the calibration, which take hours on a large model
            if build.engine != "none" and build.precision in MIN_COMPUTE_CAPABILITY and tensorrt_version() is not None:
                refuse_unsupported_precision(build.precision, environment(build))
            refuse_foreign_directory(out, export.force, (FAILED_DIR,))
            early = export.spec if spec_is_complete(export) else None  # every check that needs no model, first
            if early is not None:
                refuse_oversized_buckets(early, build.buckets)
            calibration = _data_checked(calibration, early, out)
        worker = None
        if calibration is not None:
            with stage_timer("calibration worker start"):  # it warms up while the model loads and exports
                worker = calibration_worker()
                if worker is not None:
                    workers.enter_context(worker)
        model = model_to_export(export, build.buckets)
        spec = model.spec
        if early is None:
            with stage_timer("checks before export"):
                refuse_oversized_buckets(spec, build.buckets)
                calibration = _data_checked(calibration, spec, out)
        with directory_transaction(out, command) as transaction:
            stage = transaction.stage
            with stage_timer("export inputs from the data"):
                feeds, feeds_from = _feeds_from_calibration_data(calibration, spec, export.max_batch)
            calibrated: list[Callable[[], Any]] = []  # the outcome of the calibration started beside the checks

            def calibrate(fp32_path: Path) -> None:
                assert calibration is not None
                cache_file = CALIBRATION_FILES.get(calibration.precision)
                cache = calibration.calib_cache or (out / cache_file if cache_file else None)
                if cache_file and cache and Path(cache).is_file():
                    shutil.copy2(cache, stage / cache_file)
                calibrated.append(calibration_started(stage, fp32_path, spec, calibration, worker))

            try:
                manifest = export_step(transaction, model, export, feeds, feeds_from,
                                       calibrate if calibration is not None else None)
            except BaseException:
                workers.close()  # an abandoned calibration ends before the staging folder is removed
                raise
            with stage_timer("freeing the PyTorch model"):
                del model  # not needed past export: its memory goes back before calibration
            if calibration is not None:
                # the time past the export and pass checks, which run beside the calibration
                with stage_timer(f"{calibration.precision.upper()} calibration"):
                    outcome = calibrated[0]()
                if outcome.record is None:
                    _keep_failed_attempt(stage, out, manifest)
                    raise AccuracyGateError(f"{outcome.message}; see {out / FAILED_DIR / ACCURACY_JSON} (the failed "
                                            f"attempt is in {out / FAILED_DIR})")
                manifest = manifest.with_calibration(outcome.record)
            missing: TensorRTNotInstalled | None = None
            if build.engine == "none":
                manifest = manifest.with_no_engines(build, "not built: --engine none")
            else:
                with stage_timer("engines"):
                    manifest, missing = _engines_into(stage, out, manifest, spec, build)
            manifest = replace(manifest, build_seconds=round(time.perf_counter() - start, 2))
            write_timing(stage, command, times)
            write_manifest(stage / MANIFEST, manifest)
    if missing is not None:
        raise missing
    return manifest


def _data_checked(calibration: Any | None, spec: ModelSpec | None, out: Path) -> Any | None:
    """``calibration`` after ``checked_up_front`` (data there where needed; with ``spec``, every sample read and
    checked): before the export, so that bad data fail in seconds rather than after it."""
    from calibration.calibrate import CALIBRATION_FILES
    from calibration.data import checked_up_front

    if calibration is None:
        return None
    cache_file = CALIBRATION_FILES.get(calibration.precision)
    cache = calibration.calib_cache or (out / cache_file if cache_file else None)
    return checked_up_front(calibration, spec, Path(cache) if cache else None)


def _feeds_from_calibration_data(calibration: Any | None, spec: ModelSpec, max_batch: int,
                                 ) -> tuple[FeedSource | None, str]:
    """Export inputs from the user's calibration data: its first ``max_batch`` samples of one shape.

    A batch larger than the samples read repeats them. None (the spec's example values) without
    calibration data, with ``random`` data, or when an input has no batch dimension to stack on.
    """
    from calibration.data import RANDOM, calibration_data

    if calibration is None or not (calibration.data or calibration.loader) or calibration.data == RANDOM:
        return None, ""
    if any(not i.dims or i.dims[0] != BATCH_DIM for i in spec.inputs):
        return None, ""
    data = calibration_data(calibration.data, spec, loader=calibration.loader, batch_size=1, max_samples=max_batch,
                            image=calibration.image)
    samples: list[dict[str, np.ndarray]] = []
    for sample in data.batches():
        if samples and any(sample[n].shape != samples[0][n].shape for n in sample):
            break  # a new sequence length: verification batches hold one shape
        samples.append(sample)
    stacked = {n: np.concatenate([s[n] for s in samples]) for n in samples[0]}

    def feed_at(batch: int) -> dict[str, np.ndarray]:
        rows = np.arange(batch) % len(samples)
        return {n: np.ascontiguousarray(v[rows]) for n, v in stacked.items()}

    return feed_at, f"the first {len(samples)} sample(s) of {data.description}"


def _engines_into(stage: Path, out: Path, manifest: Manifest, spec: Any, build: BuildSettings,
                  ) -> tuple[Manifest, TensorRTNotInstalled | None]:
    """Build the engines into ``stage``: the manifest that records them, and TensorRTNotInstalled (returned, not
    raised, so that the rest is committed first) when TensorRT is missing."""
    env = environment(build)
    if tensorrt_version() is None:
        return (manifest.with_no_engines(build, "not built: TensorRT is not installed here", env),
                TensorRTNotInstalled(NOT_INSTALLED.format(directory=out)))
    require_tensorrt(out)
    onnx_rel = manifest.onnx[build.precision].file if build.precision in manifest.onnx else FP32_ONNX
    entries = build_engine_files(out, stage, onnx_rel, spec, build, env=env)
    return manifest.with_engines(build, env, entries), None


def refuse_unsupported_precision(precision: str, env: Mapping[str, Any]) -> None:
    """Raise InputError (one line) when the GPU of ``env`` (``compute_capability`` "8.6") cannot run engines of
    ``precision`` (``MIN_COMPUTE_CAPABILITY``: FP8 needs 8.9+); nothing is said when the capability is unknown."""
    from compiler.backends.tensorrt.environment import parse_compute_capability

    need = MIN_COMPUTE_CAPABILITY.get(precision)
    here = parse_compute_capability(env.get("compute_capability"))
    if need is None or here is None or here >= need[0]:
        return
    raise InputError(f"{precision.upper()} engines need a GPU of compute capability {need[0][0]}.{need[0][1]}+ "
                     f"({need[1]}); this one, {env.get('gpu')}, is {env.get('compute_capability')}: build "
                     f"--int8 or --fp16 engines for it, or --engine none to stop at the {precision.upper()} ONNX")


def _keep_failed_attempt(stage: Path, out: Path, manifest: Manifest) -> None:
    """Move what the failed attempt produced to DIR/failed/, leaving the previous build untouched."""
    failed = out / FAILED_DIR
    if failed.exists():
        shutil.rmtree(failed)
    kept = stage / ".failed"
    kept.mkdir()
    for path in list(stage.iterdir()):
        if path.name not in (".failed", ".export"):
            os.replace(path, kept / path.name)
    write_manifest(kept / MANIFEST, replace(manifest, failed="accuracy gate"))
    settle_modes([p for p in kept.rglob("*") if p.is_file()])
    os.replace(kept, failed)
