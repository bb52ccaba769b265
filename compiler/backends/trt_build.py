"""TensorRT engines for a build directory: one engine per batch bucket, or one with a profile per bucket.

The precision is already in the ONNX graph (Q/DQ pairs and casts), so every network is built
strongly typed and no precision flag is ever set: on TensorRT 10 through the STRONGLY_TYPED
creation flag, on TensorRT 11 because every network is strongly typed.

Engines are built through Polygraphy's loaders, which read like the pipeline::

    EngineBytesFromNetwork(NetworkFromOnnxPath(onnx, strongly_typed=True),
                           config=PostprocessConfig(CreateConfig(profiles=[...], ...), TensorRTEnumOptions(...)),
                           save_timing_cache=STAGE/timing.cache)

The chain is only constructed here; nothing touches TensorRT until a *build step* calls it.
``tensorrt_build_step`` is the real one; tests inject a double of the build step alone, so that
everything around it (files, manifest entries, staleness, atomic commits) is tested for real.

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
import dataclasses
import json
import logging
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.core import defaults
from compiler.core.capabilities import tensorrt_version, version_tuple
from compiler.core.errors import BuildError, InputError, TensorRTNotInstalled
from compiler.core.files import atomic_write_bytes, atomic_write_text, read_json, sha256_file, sha256_files
from compiler.core.manifest import inside
from compiler.core.onnx_io import onnx_files
from compiler.core.settings import BuildSettings
from compiler.core.specs import BATCH_DIM, ModelSpec

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["SUPPORTED_MAJORS", "MIN_TENSORRT", "ENGINES_DIR", "TIMING_CACHE", "NOT_INSTALLED", "Shapes", "BuildStep",
           "tensorrt_version_problem", "require_tensorrt", "strongly_typed_flag", "profile_shapes",
           "multi_profile_shapes", "engine_profile_shapes", "timing_cache_key", "shared_timing_cache_problem",
           "build_workers",
           "TensorRTEnumOptions", "engine_loader", "build_engine_files", "tensorrt_build_step",
           "describe_parser_errors", "layer_summary", "environment", "visible_gpus", "settings_to_dict",
           "settings_from_dict", "merge_timing_cache", "manifest_engine_keys",
           "parse_compute_capability"]

log = logging.getLogger(__name__)

SUPPORTED_MAJORS = (10, 11)
# Strongly typed networks are complete from TensorRT 10.12 (NVIDIA's TensorRT 11 migration notes): every graph trtc
# writes (Q/DQ, casts) builds as written from there on.
MIN_TENSORRT = (10, 12)
ENGINES_DIR = "engines"
TIMING_CACHE = "timing.cache"
NOT_INSTALLED = ("TensorRT is not installed: engines not built; install trtc[tensorrt] on a machine with an NVIDIA "
                 "GPU and run `trtc rebuild {directory}`")

Shape = tuple[int, ...]
Shapes = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)
# (polygraphy engine loader, the shapes of each of its profiles) -> (engine bytes, layer information JSON per profile)
BuildStep = Callable[[Any, list["Shapes"]], tuple[bytes, list[str]]]


# --- which TensorRT -------------------------------------------------------------------------------------------

def tensorrt_version_problem(version: str) -> str | None:
    """Why trtc cannot use TensorRT ``version`` (one line naming the fix), or None: it needs 10.12 or later."""
    numbers = version_tuple(version)[:2]
    if len(numbers) < 2 or numbers < MIN_TENSORRT:
        floor = ".".join(map(str, MIN_TENSORRT))
        return (f"TensorRT {version} is too old: trtc needs {floor} or later (strongly typed networks are complete "
                f"from {floor}); install trtc[tensorrt] to get a supported version")
    return None


def require_tensorrt(directory: Path | str | None = None) -> str:
    """The TensorRT version, after checking that it is installed and one that trtc supports (10.12 to 11.x).

    Raises ``TensorRTNotInstalled`` (exit code 4) naming ``trtc rebuild DIR`` as the way to finish the
    directory later, or ``BuildError`` for a TensorRT older than ``MIN_TENSORRT``.
    """
    version = tensorrt_version()
    if version is None:
        raise TensorRTNotInstalled(NOT_INSTALLED.format(directory=directory if directory is not None else "DIR"))
    problem = tensorrt_version_problem(version)
    if problem:
        raise BuildError(problem)
    if version_tuple(version)[0] > SUPPORTED_MAJORS[-1]:
        log.warning("TensorRT %s is newer than trtc knows (10.x, 11.x); building anyway", version)
    return version


def strongly_typed_flag() -> bool:
    """Whether to ask Polygraphy for a STRONGLY_TYPED network (``strongly_typed=True``).

    TensorRT 10 builds a weakly typed network unless the flag is set, and then the builder's precision
    flags (which trtc never sets) would decide layer precision instead of the graph's Q/DQ and casts:
    the flag is required. TensorRT 11 networks are always strongly typed; the flag is deprecated and
    ignored there. Polygraphy 0.53 sets it with ``getattr(NetworkDefinitionCreationFlag, "STRONGLY_TYPED")``
    and fails ("not available") if a release drops the enum member, so on 11.x the flag is asked for only
    while the enum still has it. Without TensorRT here (a loader built to be inspected) the answer is 10.x's.
    """
    version = tensorrt_version()
    if version is None or version_tuple(version) < (11,):
        return True
    import tensorrt as trt

    return hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")


# --- shapes and loaders ---------------------------------------------------------------------------------------

def profile_shapes(spec: ModelSpec, bucket: int, batch_min: int | None = None) -> Shapes:
    """Min/opt/max shape of every input for the engine of one batch bucket.

    The batch ``B`` is fixed at the bucket (min = opt = max) unless ``batch_min`` lowers its min;
    every other dynamic dimension spans its declared range (``--dim S=1:128:512``). Inputs without
    dynamic dimensions get their one shape thrice.
    """
    if bucket < 1:
        raise InputError(f"bucket {bucket} is not a positive integer: write --buckets like 1,4,8,16")
    low = {name: r.min for name, r in spec.dims.items()}
    opt = {name: r.opt for name, r in spec.dims.items()}
    high = {name: r.max for name, r in spec.dims.items()}
    for values in (opt, high):
        values[BATCH_DIM] = bucket
    low[BATCH_DIM] = bucket if batch_min is None else batch_min
    return {i.name: (i.shape(low), i.shape(opt), i.shape(high)) for i in spec.inputs}


def multi_profile_shapes(spec: ModelSpec, buckets: Sequence[int]) -> list[Shapes]:
    """The profiles of a multi-profile engine, in bucket order: profile k takes batches from bucket k-1 + 1 up
    to bucket k (opt = bucket k), so together they cover every batch from 1 to the largest bucket and a
    server that does not pad (Triton's dynamic batcher) can pick a profile for any batch."""
    ordered = sorted(buckets)
    return [profile_shapes(spec, b, batch_min=(ordered[k - 1] + 1) if k else 1) for k, b in enumerate(ordered)]


def engine_profile_shapes(spec: ModelSpec, buckets: Sequence[int], multi_profile: bool) -> list[Shapes]:
    """The profiles one engine is built with, one per bucket in bucket order: the builder and the manifest
    both take them from here, so the shapes the manifest records are the ones the engine was built for."""
    if multi_profile:
        return multi_profile_shapes(spec, buckets)
    return [profile_shapes(spec, b) for b in sorted(buckets)]


@dataclass(frozen=True)
class TensorRTEnumOptions:
    """Builder-config options that Polygraphy's ``CreateConfig`` takes as TensorRT enum values.

    Given here as plain values and applied through ``PostprocessConfig`` when the config is created,
    so that the loader chain can be constructed (and inspected) where TensorRT is not installed:
    ``trt.MemoryPoolType.WORKSPACE`` as a dict key would import TensorRT at construction.
    """

    workspace_bytes: int | None = None  # None: TensorRT's default (the device's memory)
    hardware_compat: str = "none"  # settings.HARDWARE_COMPAT_LEVELS: none, same-compute-capability, ampere-plus

    def __call__(self, builder: Any, network: Any, config: trt.IBuilderConfig) -> None:
        import tensorrt as trt

        if self.workspace_bytes is not None:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace_bytes)
        levels = {"ampere-plus": trt.HardwareCompatibilityLevel.AMPERE_PLUS,
                  "same-compute-capability": trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY}
        if self.hardware_compat in levels:
            config.hardware_compatibility_level = levels[self.hardware_compat]


def engine_loader(onnx_path: Path, spec: ModelSpec, buckets_for_this_engine: Sequence[int], settings: BuildSettings,
                  timing_cache_path: Path) -> Any:
    """The Polygraphy loader that builds one engine; constructed only, nothing is built.

    One optimization profile per bucket in ``buckets_for_this_engine`` (one bucket: a single-profile
    engine). The timing cache at ``timing_cache_path`` is loaded before the build when it exists and
    saved (merged into) after it, under Polygraphy's file lock, so the buckets share it. Options from
    ``settings``: workspace limit, builder optimization level 0-5, hardware compatibility level,
    version compatibility and TF32. With version compatibility the lean runtime stays inside the engine
    (``exclude_lean_runtime`` off): a trtc directory is self-contained, and a runtime loading such an
    engine must set ``Runtime.engine_host_code_allowed = True``. TF32 follows ``settings.tf32`` (on by
    default, as in TensorRT and trtexec; Polygraphy alone would turn it off). The ONNX parser keeps its
    default flags (NATIVE_INSTANCENORM is on by default since TensorRT 10, which hardware/version
    compatibility needs). The profiles are ``engine_profile_shapes``, which the manifest records too.
    """
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        PostprocessConfig,
        Profile,
    )
    from polygraphy.logger import G_LOGGER

    profiles = []
    for shapes in engine_profile_shapes(spec, buckets_for_this_engine, settings.multi_profile):
        profile = Profile()
        for name, (low, opt, high) in shapes.items():
            profile.add(name, min=low, opt=opt, max=high)
        profiles.append(profile)
    load_cache = str(timing_cache_path) if timing_cache_path.is_file() else None
    with G_LOGGER.verbosity(G_LOGGER.WARNING):  # CreateConfig announces at INFO whether TF32 is on
        network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=strongly_typed_flag())
        config = CreateConfig(profiles=profiles,
                              tf32=settings.tf32,
                              builder_optimization_level=settings.opt_level,
                              version_compatible=settings.version_compatible or None,
                              load_timing_cache=load_cache)
        options = TensorRTEnumOptions(
            workspace_bytes=settings.workspace_mib << 20 if settings.workspace_mib is not None else None,
            hardware_compat=settings.hardware_compat)
        return EngineBytesFromNetwork(network, config=PostprocessConfig(config, options),
                                      save_timing_cache=str(timing_cache_path))


# --- the real build step ----------------------------------------------------------------------------------------

def describe_parser_errors(parser: trt.OnnxParser) -> str:
    """The ONNX parser's errors as one line each naming the node and operator TensorRT rejected."""
    lines = []
    for index in range(parser.num_errors):
        error: trt.ParserError = parser.get_error(index)
        if error.node() >= 0:
            where = f"node {error.node_name() or '#' + str(error.node())} ({error.node_operator() or '?'})"
        else:
            where = "the graph"
        stack = error.local_function_stack()
        if stack:
            where += f" in local function {' > '.join(stack)}"
        lines.append(f"{where}: {error.desc()} [{error.code().name}]")
    return "; ".join(lines) or "the parser reported no error, yet parsing failed"


def _parser_errors(onnx_path: Path) -> str | None:
    """Parse ``onnx_path`` once more with a fresh TensorRT parser and describe what it rejects, or None.

    Polygraphy logs the parser's errors and raises "Could not parse ONNX correctly", dropping the
    error objects; a second parse is cheap next to a build, and only happens on failure.
    """
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    flags = 0
    if strongly_typed_flag():
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(onnx_path)) and parser.num_errors == 0:
        return None
    return describe_parser_errors(parser)


def _deserialize(engine_bytes: bytes) -> trt.ICudaEngine:
    import tensorrt as trt

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    runtime.engine_host_code_allowed = True  # version-compatible engines carry the lean runtime; trtc built it
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    if engine is None:
        raise BuildError("TensorRT built an engine it cannot load back; run with --debug and see TensorRT's log")
    return engine


def layer_information(engine_bytes: bytes, profiles: Sequence[Shapes]) -> list[str]:
    """The engine inspector's information on every layer, as JSON, for each profile (DETAILED: trtc's configs are).

    An engine with a dynamic dimension shows "N/A due to dynamic shapes" for every layer's format and type
    unless the inspector has an execution context whose input shapes are all set (``NvInferRuntime.h``,
    ``IEngineInspector::setExecutionContext``), and every trtc engine has a dynamic batch. So profile k gets a
    context with k selected and its opt shapes set, as trtexec does; one context at a time, released after.
    """
    import tensorrt as trt
    from polygraphy import cuda

    engine = _deserialize(engine_bytes)
    inspector = engine.create_engine_inspector()
    stream = cuda.Stream()
    infos = []
    try:
        for index, shapes in enumerate(profiles):
            context = engine.create_execution_context()
            if context is None:
                raise BuildError("TensorRT could not create an execution context to inspect the engine (out of GPU "
                                 "memory?); run with --debug and see TensorRT's log")
            if engine.num_optimization_profiles > 1:  # profile 0 is the one selected at creation
                context.set_optimization_profile_async(index, stream.ptr)
                stream.synchronize()
            for name, (_, opt, _) in shapes.items():
                if not context.set_input_shape(name, opt):
                    raise BuildError(f"profile {index} of the engine does not take {name} shaped {opt}, the shape it "
                                     "was built for; run with --debug and see TensorRT's log")
            inspector.execution_context = context
            infos.append(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
            del context  # its activation memory goes before the next profile's context takes its own
    finally:
        stream.free()
    return infos


def tensorrt_build_step(loader: Any, profiles: list[Shapes]) -> tuple[bytes, list[str]]:
    """Build with TensorRT through Polygraphy: the serialized engine and its layer information JSON per profile.

    Parser failures become a ``BuildError`` that names each ONNX node and operator TensorRT rejected;
    other failures a ``BuildError`` pointing at TensorRT's log.
    """
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    severity = G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.WARNING
    try:
        with G_LOGGER.verbosity(severity):
            engine_bytes = loader()
    except (PolygraphyException, RuntimeError) as err:  # RuntimeError: what TensorRT's bindings raise
        onnx_path = Path(loader._network.path)  # polygraphy keeps the path public on NetworkFromOnnxPath
        rejected = _parser_errors(onnx_path)
        if rejected:
            raise BuildError(f"TensorRT cannot parse {onnx_path.name}: {rejected}; change or replace these "
                             "operators in the model (or export with another --opset)") from err
        raise BuildError(f"TensorRT failed to build the engine ({err}); run with --debug to see TensorRT's "
                         "log, or lower --opt-level / raise --workspace") from err
    data = bytes(engine_bytes)
    return data, layer_information(data, profiles)


# --- layer information ------------------------------------------------------------------------------------------

_TYPE_NAMES = {"float": "FP32", "fp32": "FP32", "half": "FP16", "fp16": "FP16", "bf16": "BF16", "bfloat16": "BF16",
               "int8": "INT8", "fp8": "FP8", "int4": "INT4", "fp4": "FP4", "int32": "INT32", "int64": "INT64",
               "bool": "BOOL", "uint8": "UINT8"}
_TYPE_TOKEN = re.compile(r"\b(" + "|".join(_TYPE_NAMES) + r")\b", re.IGNORECASE)


def _output_type(layer: dict[str, Any]) -> str:
    outputs = layer.get("Outputs") or []
    first = outputs[0] if outputs and isinstance(outputs[0], dict) else {}
    # TensorRT 11 has a "DataType" field; TensorRT 10 folds it into "Format/Datatype" ("Row major linear FP16 ...")
    text = str(first.get("DataType") or first.get("Format/Datatype") or "")
    match = _TYPE_TOKEN.search(text)
    return _TYPE_NAMES[match.group(1).lower()] if match else "unknown"


def layer_summary(layers_json: str) -> dict[str, Any]:
    """Layer count and the count of layers per output data type, from the inspector's JSON.

    Reads TensorRT 10's and 11's layouts; layers given only by name (an engine built without
    DETAILED profiling verbosity) are counted under "unknown".
    """
    try:
        info = json.loads(layers_json)
    except ValueError:
        return {"count": None, "output_types": {}}
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    types: dict[str, int] = {}
    for layer in layers:
        name = _output_type(layer) if isinstance(layer, dict) else "unknown"
        types[name] = types.get(name, 0) + 1
    return {"count": len(layers), "output_types": dict(sorted(types.items()))}


# --- building a directory's engines -----------------------------------------------------------------------------

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

    @property
    def name(self) -> str:
        if len(self.buckets) == 1:
            return f"b{self.buckets[0]}"
        return "profiles_b" + "_".join(str(b) for b in self.buckets)


def _build_engine(job: _EngineJob) -> list[dict[str, Any]]:
    """Build one engine into ``STAGE/engines``; one manifest entry per bucket (profile) it serves, recording
    the shapes the engine was built with (``engine_profile_shapes``, which the loader takes too)."""
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
        entries.append({
            "bucket": bucket,
            "file": engine_rel,
            "profile": profile,
            "sha256": digest,
            "bytes": len(engine_bytes),
            "shapes": {name: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for name, s in shapes.items()},
            "build_seconds": round(seconds, 3),
            "layers": {"file": layers_rel, **summary},
            "onnx": job.onnx_rel,
            "onnx_sha256": job.onnx_sha256,
        })
    return entries


def visible_gpus() -> list[str]:
    """The CUDA device ids a worker may be pinned to: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    lines = _nvidia_smi(["--query-gpu=index", "--format=csv,noheader"])
    return [line.strip() for line in lines if line.strip()]


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


def _build_in_parallel(jobs: list[_EngineJob], workers: int, gpus: list[str]) -> list[list[dict[str, Any]]]:
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


def timing_cache_key(env: dict[str, Any]) -> dict[str, Any]:
    """What a timing cache's timings hold for: the TensorRT version and the GPU (name and compute capability).

    TensorRT times tactics per version and device; timings of another GPU model or version are wrong here,
    and a combined cache of several would silently mix them.
    """
    return {"tensorrt": env.get("tensorrt"), "gpu": env.get("gpu"), "compute_capability": env.get("compute_capability")}


def _key_path(cache: Path) -> Path:
    return cache.with_name(cache.name + ".key.json")


def shared_timing_cache_problem(cache: Path, env: dict[str, Any]) -> str | None:
    """Why the shared timing cache ``cache`` (``--timing-cache``) cannot be used by a build in ``env``, or None.

    A new cache (no file yet) is fine. An existing one must carry ``cache.key.json`` with the same
    ``timing_cache_key``: one shared cache per TensorRT version and GPU.
    """
    if not cache.is_file():
        return None
    want = timing_cache_key(env)
    example = cache.with_name(f"trt{want['tensorrt']}-{str(want['gpu']).replace(' ', '_')}.cache")
    fix = f"use one shared cache per TensorRT version and GPU: give --timing-cache another path, e.g. {example}"
    try:
        have = read_json(_key_path(cache))
    except (OSError, ValueError):
        have = None
    if not isinstance(have, dict):
        return (f"--timing-cache {cache}: it does not record which TensorRT and GPU made it "
                f"({_key_path(cache).name}); {fix}")
    if timing_cache_key(have) != want:
        return (f"--timing-cache {cache} holds timings of TensorRT {have.get('tensorrt')} on {have.get('gpu')}, this "
                f"build is TensorRT {want['tensorrt']} on {want['gpu']}; {fix}")
    return None


def _seed_timing_cache(directory: Path, stage_cache: Path, settings: BuildSettings, env: dict[str, Any]) -> None:
    """Start STAGE/timing.cache from DIR/timing.cache, else from the shared ``settings.timing_cache``.

    DIR's cache holds this model's tactics and wins; it is skipped when the directory's engines were
    built with another TensorRT or GPU (``timing_cache_key``: TensorRT would not use it). The shared
    cache has been checked by ``shared_timing_cache_problem``; it is only read here, and
    ``build_engine_files`` merges the new timings into it after a successful build.
    """
    stage_cache.unlink(missing_ok=True)  # this policy decides, whatever a caller copied in before
    own = inside(directory, TIMING_CACHE, "timing cache")  # a symlink out of the directory is refused
    if own.is_file():
        try:
            built = (read_json(directory / "manifest.json") or {}).get("environment") or {}
        except (OSError, ValueError):
            built = {}
        if timing_cache_key(built) == timing_cache_key(env):
            shutil.copyfile(own, stage_cache)
            return
        log.info("not reusing %s: it was made with TensorRT %s on %s", own, built.get("tensorrt"), built.get("gpu"))
    if settings.timing_cache is not None and settings.timing_cache.is_file():
        shutil.copyfile(settings.timing_cache, stage_cache)


def _drop_unreadable_timing_cache(cache: Path) -> None:
    """Remove ``cache`` with a warning when TensorRT cannot read it: the build then starts a fresh one."""
    if not cache.is_file():
        return
    import tensorrt as trt

    config = trt.Builder(trt.Logger(trt.Logger.ERROR)).create_builder_config()
    if _read_timing_cache(config, cache) is None:
        log.warning("the timing cache seeded from the directory or --timing-cache is unreadable; starting a fresh one")
        cache.unlink()


def _read_timing_cache(config: trt.IBuilderConfig, cache: Path) -> trt.ITimingCache | None:
    """The timing cache in file ``cache`` as TensorRT reads it, or None when TensorRT cannot (why is logged at
    debug level: the callers warn in their own words)."""
    try:
        return config.create_timing_cache(cache.read_bytes())
    except (RuntimeError, TypeError, ValueError) as err:
        log.debug("timing cache %s: %s", cache, err)
        return None


def merge_timing_cache(source: Path, target: Path, env: dict[str, Any]) -> bool:
    """Fold the timings of ``source`` into the shared timing cache ``target`` made in ``env``, under a file lock.

    ``target`` is created (with its ``.key.json``) if absent; one TensorRT cannot read is a warning and
    replaced by ``source``; one whose key differs is left alone (``shared_timing_cache_problem`` refuses
    it before a build). TensorRT combines without ignoring mismatches, and a failed combine leaves
    ``target`` unchanged with a warning. Returns whether ``target`` now holds the new timings. Needs
    TensorRT: a timing cache can only be combined by TensorRT itself.
    """
    import tensorrt as trt
    from polygraphy import util

    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    config = builder.create_builder_config()
    cache = config.create_timing_cache(source.read_bytes())
    target.parent.mkdir(parents=True, exist_ok=True)
    with util.LockFile(str(target)):  # target.lock, beside the shared cache: never inside a build directory
        problem = shared_timing_cache_problem(target, env)
        if problem:
            log.warning("timing cache not merged: %s", problem)
            return False
        if target.is_file():
            previous = _read_timing_cache(config, target)
            if previous is None:
                log.warning("%s is unreadable; replacing it with this build's timings", target)
            elif not cache.combine(previous, ignore_mismatch=False):
                log.warning("TensorRT could not combine %s with this build's timings; left it unchanged", target)
                return False
        atomic_write_bytes(target, bytes(memoryview(cache.serialize())))
        atomic_write_text(_key_path(target), json.dumps(timing_cache_key(env), indent=1) + "\n")
    return True


def build_engine_files(directory: Path, stage: Path, onnx_rel: str, spec: ModelSpec, settings: BuildSettings,
                       build_step: BuildStep | None = None, *, env: dict[str, Any] | None = None,
                       ) -> list[dict[str, Any]]:
    """Build the engines of ``settings`` into ``stage``; returns their manifest entries, by bucket.

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
    (``build_workers``: one process when no GPU list is known). A shared cache made with another
    TensorRT or GPU is refused (``InputError``) before anything is built.
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
    _seed_timing_cache(directory, stage / TIMING_CACHE, settings, env)
    if build_step is None:
        _drop_unreadable_timing_cache(stage / TIMING_CACHE)

    buckets = tuple(sorted(set(settings.buckets)))
    groups = [buckets] if settings.multi_profile else [(b,) for b in buckets]
    jobs = [_EngineJob(onnx_path, onnx_rel, onnx_sha256, stage, spec, group, settings, build_step) for group in groups]
    gpus = visible_gpus() if settings.jobs > 1 and len(jobs) > 1 else []
    workers = build_workers(settings.jobs, len(jobs), gpus)
    if settings.jobs > 1 and workers < settings.jobs:
        why = "" if gpus else "; no GPU list is known (CUDA_VISIBLE_DEVICES, nvidia-smi), so one build at a time"
        log.warning("--jobs %d: %d build process(es) (%d engine(s), %d GPU(s) visible%s)", settings.jobs, workers,
                    len(jobs), len(gpus), why)
    entries: list[dict[str, Any]] = []
    if workers > 1:
        for built in _build_in_parallel(jobs, workers, gpus):
            entries += built
    else:
        for job in jobs:
            entries += _build_engine(job)
    # Polygraphy locks the cache it loads and saves with a file beside it: not part of the directory
    (stage / f"{TIMING_CACHE}.lock").unlink(missing_ok=True)
    if settings.timing_cache is not None and build_step is None and (stage / TIMING_CACHE).is_file():
        merge_timing_cache(stage / TIMING_CACHE, settings.timing_cache, env)
    return sorted(entries, key=lambda e: e["bucket"])


# --- the environment engines are built and run in --------------------------------------------------------------

def parse_compute_capability(text: Any) -> tuple[int, int] | None:
    """A compute capability as numbers: "8.6" -> (8, 6); None for anything else (None, "", "N/A")."""
    match = re.fullmatch(r"(\d+)\.(\d+)", str(text)) if text is not None else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def _nvidia_smi(args: list[str]) -> list[str]:
    """Lines nvidia-smi prints for ``args``; empty when it is absent or fails (no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.debug("nvidia-smi failed: %s", err)
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def _cuda_version(number: int) -> str:
    """CUDA's integer versions: 12040 -> "12.4"."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _gpu_from_cuda_python() -> dict[str, Any]:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return {}
    info: dict[str, Any] = {}
    try:
        err, version = cudart.cudaRuntimeGetVersion()
        if int(err) == 0:
            info["cuda_runtime"] = _cuda_version(version)
        err, version = cudart.cudaDriverGetVersion()
        if int(err) == 0 and version:
            info["cuda_driver"] = _cuda_version(version)
        err, props = cudart.cudaGetDeviceProperties(0)
        if int(err) == 0:
            name = props.name
            info["gpu"] = (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")
            info["compute_capability"] = f"{props.major}.{props.minor}"
    except (RuntimeError, OSError) as exc:  # cuda-python installed, the CUDA runtime library not loadable
        log.debug("cuda-python cannot query the GPU: %s", exc)
    return info


def _gpu_from_torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {}
    info: dict[str, Any] = {}
    if torch.version.cuda:
        info["cuda_runtime"] = torch.version.cuda
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            info["gpu"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = f"{major}.{minor}"
    except RuntimeError as err:  # a driver that torch sees but cannot initialize
        log.debug("torch cannot query the GPU: %s", err)
    return info


def _gpu_from_nvidia_smi() -> dict[str, Any]:
    lines = _nvidia_smi(["--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"])
    if not lines:  # drivers before 510 do not know the compute_cap field
        lines = _nvidia_smi(["--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not lines:
        return {}
    parts = [p.strip() for p in lines[0].split(",")]
    info: dict[str, Any] = {"gpu": parts[0], "driver": parts[-1]}
    if len(parts) == 3 and parse_compute_capability(parts[1]):
        info["compute_capability"] = parts[1]
    header = re.search(r"CUDA Version:\s*([0-9.]+)", "\n".join(_nvidia_smi([])))
    if header:
        info["cuda_driver"] = header.group(1)
    return info


def environment(settings: BuildSettings | None = None) -> dict[str, Any]:
    """Where engines are built or run: TensorRT, CUDA, GPU, platform, and the compatibility settings.

    Keys: ``tensorrt`` (version or None when not installed), ``cuda_runtime`` (e.g. "12.9"),
    ``cuda_driver`` (the newest CUDA the driver supports), ``driver`` (driver version),
    ``gpu`` (name of device 0), ``compute_capability`` ("9.0"), ``platform`` ("linux-x86_64"),
    ``hardware_compat`` (the level) and ``version_compatible`` (from ``settings``; "none"/False without). GPU facts come
    from cuda-python when installed, then torch (a CUDA build that sees a GPU), then nvidia-smi; a
    fact no source gives is None. Never raises for a missing TensorRT, driver or GPU.
    """
    info: dict[str, Any] = {"tensorrt": tensorrt_version(), "cuda_runtime": None, "cuda_driver": None,
                            "driver": None, "gpu": None, "compute_capability": None}
    gpu_keys = ("cuda_runtime", "cuda_driver", "driver", "gpu", "compute_capability")
    for source in (_gpu_from_cuda_python, _gpu_from_torch, _gpu_from_nvidia_smi):
        if all(info[key] is not None for key in gpu_keys):
            break
        for key, value in source().items():
            if info.get(key) is None:
                info[key] = value
    info["platform"] = f"{sys.platform}-{platform.machine()}"
    info["hardware_compat"] = settings.hardware_compat if settings else "none"
    info["version_compatible"] = bool(settings.version_compatible) if settings else False
    return info


# --- settings and specs as the manifest stores them -------------------------------------------------------------

def settings_to_dict(settings: BuildSettings) -> dict[str, Any]:
    """``BuildSettings`` as ``manifest["build"]``: JSON values (lists, strings) under the field names."""
    out = dataclasses.asdict(settings)
    out["buckets"] = list(settings.buckets)
    out["timing_cache"] = str(settings.timing_cache) if settings.timing_cache is not None else None
    return out


def recorded_tf32(build: Any) -> bool:
    """Whether FP32 math may use TF32 for a build: its ``tf32``; a build section without one (a trtc that did not
    record it) built with TF32 off; no build section (or not a mapping: the manifest's checks name that): the
    default. One rule for ``trtc rebuild`` and for the serving and bench backends."""
    if not isinstance(build, dict):
        return defaults.TF32
    return bool(build.get("tf32", False))


def settings_from_dict(data: dict[str, Any]) -> BuildSettings:
    """``BuildSettings`` from ``manifest["build"]``; keys this trtc does not know are ignored (with a note)."""
    known = {f.name for f in dataclasses.fields(BuildSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        log.info("manifest build settings %s are unknown to this trtc and ignored", ", ".join(unknown))
    values = {k: v for k, v in data.items() if k in known}
    values["tf32"] = recorded_tf32(data)
    if "buckets" in values:
        values["buckets"] = tuple(int(b) for b in values["buckets"])
    if values.get("timing_cache") is not None:
        values["timing_cache"] = Path(values["timing_cache"])
    try:
        return BuildSettings(**values)
    except TypeError as err:
        raise InputError(f"manifest build settings do not parse ({err}); rebuild with `trtc build --force`") from err


def manifest_engine_keys(settings: BuildSettings, env: dict[str, Any], entries: list[dict[str, Any]],
                         ) -> dict[str, Any]:
    """The manifest keys an engine build writes: ``build`` (the settings, so ``trtc rebuild`` can repeat
    them), ``environment`` (where the engines were built, for ``trtc check``) and ``engines``."""
    return {"build": settings_to_dict(settings),
            "environment": {**env, "hardware_compat": settings.hardware_compat,
                            "version_compatible": settings.version_compatible},
            "engines": entries}
