"""A Triton Inference Server model repository from a build directory (``trtc export-triton``).

Writes ``REPO/NAME/config.pbtxt`` and ``REPO/NAME/1/`` with either

* the TensorRT engine as ``model.plan`` (platform ``tensorrt_plan``), one optimization profile per
  bucket, all listed in the instance group so that Triton picks the profile that fits a batch; or
* the build's ONNX for its precision as ``model.onnx`` plus its external data (platform
  ``onnxruntime_onnx``), for machines without TensorRT or directories without engines.

The config enables dynamic batching with the buckets as preferred batch sizes. Triton's dynamic
batcher forms batches of any size up to ``max_batch_size`` and does not pad them, so a plan is
only exported when its profiles take every batch size from 1 to the largest bucket (one plan
file holding a profile per bucket: ``trtc build --multi-profile``); otherwise ``auto`` falls
back to the ONNX Runtime variant and says why.

Triton loads a plan only with the TensorRT that built it (its container's TensorRT), or, for a
plan built ``--version-compatible``, a later TensorRT of the same major (a TensorRT 10 plan: 11 too)
when Triton runs with ``--backend-config=tensorrt,version-compatible=true``; and only on the GPU model
that built it unless built ``--hardware-compat``. ``1/tensorrt_version.txt`` beside ``model.plan``
says which (the version on its first line), and the command prints it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.backends.tensorrt.compat import gpus_that_run, later_runtimes
from compiler.core.errors import InputError
from compiler.core.manifest import spec_from_manifest
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["TritonModel", "triton_repository", "model_config_text", "plan_requirement", "TRITON_BACKENDS",
           "PLAN_VERSION_FILE"]

log = logging.getLogger(__name__)

TRITON_BACKENDS = ("auto", "tensorrt", "onnxruntime")
PLATFORMS = {"tensorrt": "tensorrt_plan", "onnxruntime": "onnxruntime_onnx"}
MODEL_FILES = {"tensorrt": "model.plan", "onnxruntime": "model.onnx"}
PLAN_VERSION_FILE = "tensorrt_version.txt"  # beside model.plan
# ONNX TensorProto element types -> Triton's DataType (model_config.proto)
TRITON_TYPES = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16", 6: "TYPE_INT32",
                7: "TYPE_INT64", 8: "TYPE_STRING", 9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64", 12: "TYPE_UINT32",
                13: "TYPE_UINT64", 16: "TYPE_BF16"}


@dataclass(frozen=True)
class TritonTensor:
    name: str
    data_type: str  # TYPE_FP32, ...
    dims: tuple[int, ...]  # without the batch dimension; -1 for a dynamic size


@dataclass(frozen=True)
class TritonModel:
    """What ``config.pbtxt`` says about one model."""

    name: str
    backend: str  # "tensorrt" | "onnxruntime"
    max_batch_size: int
    inputs: tuple[TritonTensor, ...]
    outputs: tuple[TritonTensor, ...]
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    instances: int
    kind: str  # KIND_GPU | KIND_AUTO | KIND_CPU
    profiles: tuple[int, ...] = ()  # TensorRT optimization profiles the instances may use


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tensor_text(tensor: TritonTensor) -> str:
    lines = ["  {", f"    name: {_quote(tensor.name)}", f"    data_type: {tensor.data_type}"]
    if tensor.dims:
        lines.append(f"    dims: [ {', '.join(map(str, tensor.dims))} ]")
    else:  # a tensor of shape [B]: Triton wants one dim, reshaped away
        lines += ["    dims: [ 1 ]", "    reshape: { shape: [ ] }"]
    return "\n".join([*lines, "  }"])


def model_config_text(model: TritonModel) -> str:
    """``config.pbtxt`` in protobuf text format (Triton's ``inference.ModelConfig``)."""
    group = [f"    count: {model.instances}", f"    kind: {model.kind}"]
    if model.profiles:
        group.append(f"    profile: [ {', '.join(_quote(str(p)) for p in model.profiles)} ]")
    parts = [
        f"name: {_quote(model.name)}",
        f"platform: {_quote(PLATFORMS[model.backend])}",
        f"max_batch_size: {model.max_batch_size}",
        "input [\n" + ",\n".join(_tensor_text(t) for t in model.inputs) + "\n]",
        "output [\n" + ",\n".join(_tensor_text(t) for t in model.outputs) + "\n]",
        "dynamic_batching {\n"
        f"  preferred_batch_size: [ {', '.join(map(str, model.preferred_batch_sizes))} ]\n"
        f"  max_queue_delay_microseconds: {model.max_queue_delay_us}\n"
        "}",
        "instance_group [\n  {\n" + "\n".join(group) + "\n  }\n]",
        f"default_model_filename: {_quote(MODEL_FILES[model.backend])}",
    ]
    return "\n".join(parts) + "\n"


def _io_tensors(onnx_path: Path, spec: ModelSpec) -> tuple[tuple[TritonTensor, ...], tuple[TritonTensor, ...]]:
    """Inputs from the spec, outputs from the ONNX graph; the batch dimension dropped, dynamic sizes -1."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    inputs = []
    for i in spec.inputs:
        if not i.dims or i.dims[0] != BATCH_DIM:
            raise InputError(f"input {i}: Triton batches along the first dimension and B is not first; re-export "
                             "with the batch first")
        inputs.append(TritonTensor(i.name, _triton_type(types.get(i.name), i.name),
                                   tuple(d if isinstance(d, int) else -1 for d in i.dims[1:])))
    outputs = []
    for o in graph.output:
        dims = o.type.tensor_type.shape.dim
        if not dims or dims[0].dim_value:
            raise InputError(f"output {o.name!r} has no dynamic batch as its first dimension; Triton cannot batch "
                             "this model: re-export it with --input NAME:Bx...")
        outputs.append(TritonTensor(o.name, _triton_type(o.type.tensor_type.elem_type, o.name),
                                    tuple(d.dim_value if d.dim_value else -1 for d in dims[1:])))
    return tuple(inputs), tuple(outputs)


def _triton_type(elem_type: int | None, name: str) -> str:
    if elem_type not in TRITON_TYPES:
        raise InputError(f"tensor {name!r} has ONNX element type {elem_type}, which Triton has no type for")
    return TRITON_TYPES[elem_type]


def _plan_for_triton(directory: Path, manifest: dict[str, Any]) -> tuple[Path, tuple[int, ...], int]:
    """(engine file, profile indices, largest batch) of a plan Triton can serve; InputError saying why not."""
    entries = manifest.get("engines") or []
    if not entries:
        raise InputError(f"{directory} has no TensorRT engines ({manifest.get('engines_note') or 'none built'}); run "
                         f"`trtc rebuild {directory}` with TensorRT, or export with --backend onnxruntime")
    files = sorted({str(e["file"]) for e in entries})
    if len(files) != 1:
        raise InputError(f"Triton serves one plan per model and {directory} has one engine per bucket ({len(files)} "
                         "files); build with --multi-profile for one engine with a profile per bucket, or export "
                         "with --backend onnxruntime")
    batched = [i.name for i in spec_from_manifest(manifest).inputs if i.dims and i.dims[0] == BATCH_DIM]
    ranges = []
    for entry in entries:
        shapes = (entry.get("shapes") or {}).get(batched[0]) if batched else None
        if not shapes:
            raise InputError(f"the manifest's engine entry for bucket {entry.get('bucket')} has no shapes for "
                             f"{batched[0] if batched else 'a batched input'}; rebuild with `trtc rebuild {directory}`")
        ranges.append((int(shapes["min"][0]), int(shapes["max"][0])))
    largest = max(high for _, high in ranges)
    missing = [b for b in range(1, largest + 1) if not any(low <= b <= high for low, high in ranges)]
    if missing:
        taken = ", ".join(f"{low}" if low == high else f"{low}-{high}" for low, high in sorted(ranges))
        raise InputError(f"Triton's dynamic batcher sends any batch from 1 to {largest} without padding, but the "
                         f"profiles of {files[0]} take batches {taken} only (e.g. not {missing[0]}); build profiles "
                         "whose batch ranges cover 1 to the largest bucket, or export with --backend onnxruntime")
    profiles = tuple(sorted({int(e.get("profile", 0)) for e in entries}))
    from compiler.core.manifest import verified_file

    return verified_file(directory, entries[0], "engine"), profiles, largest


def plan_requirement(manifest: dict[str, Any]) -> tuple[str, str]:
    """(TensorRT version, one line saying which Triton can load the plan and on which GPUs) for a directory's
    engines, by the rules of ``compiler.backends.tensorrt.compat``."""
    env = manifest.get("environment") or {}
    build = manifest.get("build") or {}
    version = str(env.get("tensorrt") or "unknown")
    gpus = gpus_that_run(env, build.get("hardware_compat", env.get("hardware_compat")))
    if build.get("version_compatible"):
        return version, (f"model.plan was built version-compatible with TensorRT {version}: Triton loads it with "
                         f"{later_runtimes(version)} when started with "
                         f"--backend-config=tensorrt,version-compatible=true; {gpus}")
    return version, (f"model.plan was built with TensorRT {version}: Triton loads it only if its TensorRT is "
                     f"exactly {version} (pick the Triton container that ships it), or rebuild with "
                     f"--version-compatible; {gpus}")


def triton_repository(directory: str | Path, repo: str | Path, *, name: str | None = None, backend: str = "auto",
                      instances: int = 1, max_wait_ms: float = 10.0, force: bool = False) -> Path:
    """Write ``repo/NAME`` (config.pbtxt, 1/model.plan or 1/model.onnx + data); returns that folder.

    ``backend``: ``tensorrt`` (the plan; InputError when Triton could not serve it), ``onnxruntime``
    or ``auto`` (the plan when it can be served, else the ONNX Runtime variant, logged with the
    reason). ``name`` defaults to the directory's name. An existing ``repo/NAME`` is replaced only
    with ``force``; the new folder appears whole (staged beside ``repo``, then renamed).
    """
    from compiler.core.files import require_directory
    from compiler.core.manifest import onnx_for, read_manifest
    from compiler.core.onnx_io import onnx_files

    directory = Path(directory)
    repo = Path(repo)
    if backend not in TRITON_BACKENDS:
        raise InputError(f"--backend {backend!r}: use one of {', '.join(TRITON_BACKENDS)}")
    if instances < 1:
        raise InputError(f"--instances {instances}: Triton needs at least one instance")
    manifest = read_manifest(directory)
    spec = spec_from_manifest(manifest)
    name = name or directory.resolve().name
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise InputError(f"model name {name!r}: Triton takes the folder name as the model name; pass --name NAME "
                         "without slashes or a leading dot")
    onnx_path = onnx_for(directory, manifest)
    chosen = backend
    plan: tuple[Path, tuple[int, ...], int] | None = None
    if backend in ("auto", "tensorrt"):
        try:
            plan = _plan_for_triton(directory, manifest)
            chosen = "tensorrt"
        except InputError as err:
            if backend == "tensorrt":
                raise
            if manifest.get("engines"):
                log.warning("writing the ONNX Runtime variant: %s", err)
            chosen = "onnxruntime"
    inputs, outputs = _io_tensors(onnx_path, spec)
    buckets = tuple(sorted(int(b) for b in manifest.get("buckets") or ()))
    max_batch = plan[2] if plan else max(buckets)
    model = TritonModel(name=name, backend=chosen, max_batch_size=max_batch, inputs=inputs, outputs=outputs,
                        preferred_batch_sizes=tuple(b for b in buckets if b <= max_batch),
                        max_queue_delay_us=round(max_wait_ms * 1000), instances=instances,
                        kind="KIND_GPU" if chosen == "tensorrt" else "KIND_AUTO",
                        profiles=plan[1] if plan else ())
    target = repo / name
    if target.exists() and not force:
        raise InputError(f"{target} exists; pass --force to replace it")
    require_directory(repo, "--repo")
    repo.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".trtc-triton-{name}-", dir=repo.resolve().parent))
    try:
        version = stage / name / "1"
        version.mkdir(parents=True)
        if plan is not None:
            shutil.copyfile(plan[0], version / MODEL_FILES["tensorrt"])
            trt_version, requirement = plan_requirement(manifest)
            (version / PLAN_VERSION_FILE).write_text(f"{trt_version}\n{requirement}\n")
            log.info("%s", requirement)
        else:
            graph, *data = onnx_files(onnx_path)
            shutil.copyfile(graph, version / MODEL_FILES["onnxruntime"])
            for path in data:  # external data keeps the name the graph refers to
                shutil.copyfile(path, version / path.relative_to(onnx_path.parent))
        (stage / name / "config.pbtxt").write_text(model_config_text(model))
        _replace(stage / name, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s for Triton (%s, max batch %d)", target, PLATFORMS[chosen], max_batch)
    return target


def _replace(new: Path, target: Path) -> None:
    """Put ``new`` at ``target`` by renames; an old ``target`` is moved aside first and then removed."""
    old = None
    if target.exists():
        old = new.parent / (target.name + ".old")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
