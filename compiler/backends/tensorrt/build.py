"""TensorRT engines for a build directory: one engine per batch bucket, or one with a profile per bucket.

``build_engine_files`` is the stage: it checks the environment and the shared timing cache, seeds the
staging folder's cache, builds each engine through a *build step* (``build_step.tensorrt_build_step`` by
default; tests inject a double of the step alone, so that everything around it is tested for real), in
worker processes pinned to one GPU each with ``--jobs``, and returns the manifest's engine records.

Directory layout written by ``build_engine_files`` (into the staging folder, committed by the caller)::

    engines/b4.engine          serialized engine for batch 4
    engines/b4.layers.json     the engine inspector's layer information (which layers run in INT8/FP16)
    engines/profiles_b1_4.p0.layers.json   ... per profile of a multi-profile engine
    timing.cache               TensorRT's tactic timing cache, shared by the buckets and by rebuilds

Polygraphy's file lock (``timing.cache.lock``) is removed from the staging folder before anything is
committed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from compiler.backends.tensorrt.build_step import tensorrt_build_step
from compiler.backends.tensorrt.environment import (
    environment,
    parse_compute_capability,
    same_gpu_model,
    visible_gpus,
)
from compiler.backends.tensorrt.layers import layer_summary
from compiler.backends.tensorrt.loaders import engine_loader
from compiler.backends.tensorrt.profiles import Shapes, engine_profile_shapes
from compiler.backends.tensorrt.timing_cache import (
    TIMING_CACHE,
    drop_unreadable_timing_cache,
    merge_timing_cache,
    seed_timing_cache,
    shared_timing_cache_problem,
)
from compiler.backends.tensorrt.versions import require_tensorrt
from compiler.core.errors import BuildError, InputError
from compiler.core.files import atomic_write_bytes, atomic_write_text, sha256_file, sha256_files
from compiler.core.manifest import EngineRecord, ShapeRange
from compiler.core.onnx_io import onnx_files
from compiler.core.settings import BuildSettings
from compiler.core.specs import ModelSpec

__all__ = ["ENGINES_DIR", "BuildStep", "build_engine_files", "build_workers"]

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"

# (polygraphy engine loader, the shapes of each of its profiles) -> (engine bytes, layer information JSON per profile)
BuildStep = Callable[[Any, list[Shapes]], tuple[bytes, list[str]]]


@dataclass(frozen=True)
class _EngineJob:
    """Everything one engine build needs, picklable for a worker process."""

    onnx_path: Path
    onnx_rel: str
    onnx_sha256: str
    stage: Path
    spec: ModelSpec
    buckets: tuple[int, ...]
    settings: BuildSettings
    build_step: BuildStep | None
    gpu_model: dict[str, Any] | None = None  # in a worker pinned to one GPU: the GPU the engines must be built on

    @property
    def name(self) -> str:
        if len(self.buckets) == 1:
            return f"b{self.buckets[0]}"
        return "profiles_b" + "_".join(str(b) for b in self.buckets)


def _build_engine(job: _EngineJob) -> list[EngineRecord]:
    """Build one engine into ``STAGE/engines``; one engine record per bucket (profile) it serves, recording
    the shapes the engine was built with (``engine_profile_shapes``, which the loader takes too)."""
    if job.gpu_model is not None:
        _check_worker_gpu(job.gpu_model)
    cache = job.stage / TIMING_CACHE
    per_profile = engine_profile_shapes(job.spec, job.buckets, job.settings.multi_profile)
    loader = engine_loader(job.onnx_path, job.spec, job.buckets, job.settings, cache)
    step = job.build_step or tensorrt_build_step
    start = time.perf_counter()
    engine_bytes, layers_per_profile = step(loader, per_profile)
    seconds = time.perf_counter() - start
    if len(layers_per_profile) != len(per_profile):
        # an internal error (a build step that breaks its contract), not the user's: it keeps its traceback
        raise RuntimeError(f"the build step returned layer information for {len(layers_per_profile)} profile(s), "
                           f"the engine has {len(per_profile)}")
    engine_rel = f"{ENGINES_DIR}/{job.name}.engine"
    atomic_write_bytes(job.stage / engine_rel, engine_bytes)
    digest = sha256_file(job.stage / engine_rel)
    entries = []
    for profile, (bucket, shapes, layers_json) in enumerate(zip(sorted(job.buckets), per_profile,
                                                                  layers_per_profile)):
        layers_rel = (f"{ENGINES_DIR}/{job.name}.layers.json" if len(per_profile) == 1
                      else f"{ENGINES_DIR}/{job.name}.p{profile}.layers.json")
        try:
            layers_text = json.dumps(json.loads(layers_json), indent=1) + "\n"
        except ValueError:
            layers_text = layers_json
        atomic_write_text(job.stage / layers_rel, layers_text)
        summary = layer_summary(layers_json)
        log.info("built %s (bucket %d) in %.1f s: %.1f MiB, %s layers %s", engine_rel, bucket, seconds,
                 len(engine_bytes) / 2**20, summary["count"], summary["output_types"])
        entries.append(EngineRecord(
            bucket=bucket, file=engine_rel, profile=profile, sha256=digest, bytes=len(engine_bytes),
            shapes={name: ShapeRange(tuple(s[0]), tuple(s[1]), tuple(s[2])) for name, s in shapes.items()},
            build_seconds=round(seconds, 3), layers={"file": layers_rel, **summary}, onnx=job.onnx_rel,
            onnx_sha256=job.onnx_sha256))
    return entries


def _check_worker_gpu(gpu_model: dict[str, Any]) -> None:
    """In a build worker: ``BuildError`` unless its GPU is of the model the build's environment names.

    The manifest records one environment for every engine of a directory (and the engines share one timing
    cache), so on a host with GPUs of several models the workers must be pinned to GPUs of that one model.
    """
    here = environment(device=0)  # the worker sees its one GPU as device 0
    if not same_gpu_model(gpu_model, here):
        raise BuildError(f"--jobs: the build worker on GPU {os.environ.get('CUDA_VISIBLE_DEVICES')} has a "
                         f"{here['gpu']} (compute capability {here['compute_capability']}), but this build's "
                         f"engines are for the {gpu_model['gpu']} (compute capability "
                         f"{gpu_model['compute_capability']}) that the manifest records; set CUDA_VISIBLE_DEVICES "
                         "to GPUs of that one model, or build with --jobs 1")


def _pin_worker_to_gpu(gpu_ids: Any) -> None:
    """Worker initializer: take one GPU id from the queue before anything initializes CUDA."""
    gpu = gpu_ids.get(timeout=60)  # put() by the parent goes through a feeder thread: wait for it
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu


def build_workers(jobs: int, engines: int, gpus: Sequence[str]) -> int:
    """How many build processes ``--jobs jobs`` starts for ``engines`` engines with ``gpus`` known GPU ids.

    One per GPU, never more than engines or jobs; and one when no GPU list is known: several builds on one
    GPU time their tactics under each other's load and pick slower kernels.
    """
    if jobs <= 1 or engines <= 1 or not gpus:
        return 1
    return min(jobs, engines, len(gpus))


def _build_in_parallel(jobs: list[_EngineJob], workers: int, gpus: list[str]) -> list[list[EngineRecord]]:
    """Run ``jobs`` in ``workers`` spawned processes, each pinned to its own GPU (``build_workers``)."""
    context = multiprocessing.get_context("spawn")  # forked CUDA state is unusable; spawn starts clean
    gpu_ids = context.Queue()
    for index in range(workers):
        gpu_ids.put(gpus[index])
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context,
                                                initializer=_pin_worker_to_gpu, initargs=(gpu_ids,)) as pool:
        futures = [pool.submit(_build_engine, job) for job in jobs]
        try:
            return [future.result() for future in futures]
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the first failure stops the queued builds
            raise


def build_engine_files(directory: Path, stage: Path, onnx_rel: str, spec: ModelSpec, settings: BuildSettings,
                       build_step: BuildStep | None = None, *, env: dict[str, Any] | None = None,
                       ) -> list[EngineRecord]:
    """Build the engines of ``settings`` into ``stage``; returns their records for the manifest, by bucket.

    ``onnx_rel`` names the ONNX file relative to the directory; it is read from ``stage`` when the
    current command wrote it there (``trtc build``), else from ``directory`` (``trtc rebuild``).
    One engine per bucket (``engines/b4.engine``) or, with ``settings.multi_profile``, one engine with a
    profile per bucket (one entry per bucket, each naming the shared file and its ``profile`` index).
    Each engine gets ``engines/<name>.layers.json``. ``stage/timing.cache`` is seeded from DIR's (or the
    shared) cache and grows with every build; after all builds succeed it is merged into
    ``settings.timing_cache`` too. Nothing is written outside ``stage`` except that shared cache.

    ``build_step`` turns a loader into (engine bytes, layer JSON); None means TensorRT
    (``tensorrt_build_step``), which must be installed (``TensorRTNotInstalled`` otherwise). With
    ``settings.jobs`` > 1 single-profile engines are built in that many processes, one GPU each
    (``build_workers``: one process when no GPU list is known), each checking that its GPU is of the
    model ``env`` names (``BuildError`` otherwise). A shared cache made with another TensorRT or GPU is
    refused (``InputError``) before anything is built.
    ``env`` is the environment the engines are built in (``environment(settings)`` when None).
    """
    if settings.engine == "none":
        log.info("engines not built: --engine none")
        return []
    if build_step is None:
        require_tensorrt(directory)
    env = env if env is not None else environment(settings)
    capability = parse_compute_capability(env.get("compute_capability"))
    if settings.hardware_compat == "ampere-plus" and capability is not None and capability < (8, 0):
        raise BuildError(f"--hardware-compat (Ampere+) engines must be built on an Ampere or newer GPU (compute "
                         f"capability 8.0+); this one, {env.get('gpu')}, is {env.get('compute_capability')}")
    onnx_path = stage / onnx_rel if (stage / onnx_rel).is_file() else directory / onnx_rel
    if not onnx_path.is_file():
        raise InputError(f"{directory / onnx_rel}: no such ONNX file; run `trtc export` or `trtc build` into "
                         f"{directory} first")
    if settings.timing_cache is not None:
        problem = shared_timing_cache_problem(settings.timing_cache, env)
        if problem:
            raise InputError(problem)
    onnx_sha256 = sha256_files(onnx_files(onnx_path))
    (stage / ENGINES_DIR).mkdir(parents=True, exist_ok=True)
    seed_timing_cache(directory, stage / TIMING_CACHE, settings, env)
    if build_step is None:
        drop_unreadable_timing_cache(stage / TIMING_CACHE)

    buckets = tuple(sorted(set(settings.buckets)))
    groups = [buckets] if settings.multi_profile else [(b,) for b in buckets]
    jobs = [_EngineJob(onnx_path, onnx_rel, onnx_sha256, stage, spec, group, settings, build_step) for group in groups]
    gpus = visible_gpus() if settings.jobs > 1 and len(jobs) > 1 else []
    workers = build_workers(settings.jobs, len(jobs), gpus)
    if settings.jobs > 1 and workers < settings.jobs:
        why = "" if gpus else "; no GPU list is known (CUDA_VISIBLE_DEVICES, nvidia-smi), so one build at a time"
        log.warning("--jobs %d: %d build process(es) (%d engine(s), %d GPU(s) visible%s)", settings.jobs, workers,
                    len(jobs), len(gpus), why)
    entries: list[EngineRecord] = []
    if workers > 1:
        model = {"gpu": env.get("gpu"), "compute_capability": env.get("compute_capability")}
        jobs = [replace(job, gpu_model=model) for job in jobs]
        for built in _build_in_parallel(jobs, workers, gpus):
            entries += built
    else:
        for job in jobs:
            entries += _build_engine(job)
    # Polygraphy locks the cache it loads and saves with a file beside it: not part of the directory
    (stage / f"{TIMING_CACHE}.lock").unlink(missing_ok=True)
    if settings.timing_cache is not None and build_step is None and (stage / TIMING_CACHE).is_file():
        merge_timing_cache(stage / TIMING_CACHE, settings.timing_cache, env)
    return sorted(entries, key=lambda e: e.bucket)
