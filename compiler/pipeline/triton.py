"""A Triton Inference Server model repository from a build directory (``trtc export-triton``).

Writes ``REPO/NAME/config.pbtxt`` and ``REPO/NAME/1/`` for one of three platforms:

* ``tensorrt_plan``: the TensorRT engine as ``model.plan``, one optimization profile per bucket, all
  listed in the instance group so that Triton picks the profile that fits a batch;
* ``onnxruntime_onnx``: the build's ONNX for its precision as ``model.onnx`` plus its external data;
* ``trtc``: Triton's Python backend running trtc's own runtime (``compiler.serve.triton_model``): a
  ``model.py``, and the build directory itself as ``1/build`` (its manifest and every file the
  manifest names), served through ``compiler.load`` (bucket routing, padding, CUDA graphs; TensorRT
  engines where TensorRT imports, ONNX Runtime otherwise). The folders its code is imported from
  (trtc's and this environment's packages) are recorded in ``config.pbtxt`` as the parameter
  ``trtc_python_path``, because the Python backend's stub does not run this environment's Python.
  One instance per GPU (``--instances`` per GPU), or ``--instances`` on the CPU (``KIND_AUTO``).

The config enables dynamic batching with the buckets as preferred batch sizes. Triton's dynamic
batcher forms batches of any size up to ``max_batch_size`` and does not pad them, so a plan is
only exported when its profiles take every batch size from 1 to the largest bucket (one plan
file holding a profile per bucket: ``trtc build --multi-profile``). ``auto`` writes that plan
where it fits; where the directory has engines that Triton's TensorRT backend cannot serve (one
per bucket, or profiles that leave batch sizes out) it writes the ``trtc`` entry, which pads, and
says why; a directory without engines gets the ONNX Runtime variant.

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
import site
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiler.backends.tensorrt.compat import gpus_that_run, later_runtimes
from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.manifest import Manifest
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["TritonModel", "TritonTensor", "triton_repository", "model_config_text", "plan_requirement",
           "PLATFORM_CHOICES", "PLAN_VERSION_FILE", "default_python_path", "build_files"]

log = logging.getLogger(__name__)

TRT_PLAN, ORT_ONNX, TRTC = "tensorrt_plan", "onnxruntime_onnx", "trtc"
PLATFORM_CHOICES = ("auto", TRT_PLAN, ORT_ONNX, TRTC)
MODEL_FILES = {TRT_PLAN: "model.plan", ORT_ONNX: "model.onnx", TRTC: "model.py"}
SERVING_BACKENDS = ("auto", "tensorrt", "onnxruntime")  # what compiler.load runs in a trtc entry
# A trtc entry takes requests of up to this many times the largest bucket: trtc's runtime runs a larger batch as
# bucket-sized parts (Triton's batcher still forms batches of the preferred sizes, the buckets, where it can)
TRTC_MAX_BATCH_FACTOR = 4
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
    platform: str  # tensorrt_plan | onnxruntime_onnx | trtc (Triton's Python backend)
    max_batch_size: int
    inputs: tuple[TritonTensor, ...]
    outputs: tuple[TritonTensor, ...]
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    instances: int
    kind: str  # KIND_GPU | KIND_AUTO | KIND_CPU
    profiles: tuple[int, ...] = ()  # TensorRT optimization profiles the instances may use
    parameters: tuple[tuple[str, str], ...] = ()  # (key, string value), read by the model (trtc)


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
        'backend: "python"' if model.platform == TRTC else f"platform: {_quote(model.platform)}",
        f"max_batch_size: {model.max_batch_size}",
        "input [\n" + ",\n".join(_tensor_text(t) for t in model.inputs) + "\n]",
        "output [\n" + ",\n".join(_tensor_text(t) for t in model.outputs) + "\n]",
        "dynamic_batching {\n"
        f"  preferred_batch_size: [ {', '.join(map(str, model.preferred_batch_sizes))} ]\n"
        f"  max_queue_delay_microseconds: {model.max_queue_delay_us}\n"
        "}",
        "instance_group [\n  {\n" + "\n".join(group) + "\n  }\n]",
        f"default_model_filename: {_quote(MODEL_FILES[model.platform])}",
    ]
    parts += [f"parameters {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(value)} }}\n}}"
              for key, value in model.parameters]
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


def _plan_for_triton(directory: Path, manifest: Manifest) -> tuple[Path, tuple[int, ...], int]:
    """(engine file, profile indices, largest batch) of a plan Triton can serve; InputError saying why not."""
    entries = manifest.engines
    if not entries:
        raise InputError(f"{directory} has no TensorRT engines ({manifest.engines_note or 'none built'}); run "
                         f"`trtc rebuild {directory}` with TensorRT, or export with --platform onnxruntime_onnx")
    files = sorted({e.file for e in entries})
    if len(files) != 1:
        raise InputError(f"Triton serves one plan per model and {directory} has one engine per bucket ({len(files)} "
                         "files); build with --multi-profile for one engine with a profile per bucket, or export "
                         "with --platform trtc (which pads each batch to its bucket)")
    batched = [i.name for i in manifest.spec.inputs if i.dims and i.dims[0] == BATCH_DIM]
    ranges = []
    for entry in entries:
        shapes = entry.shapes.get(batched[0]) if batched else None
        if not shapes:
            raise InputError(f"the manifest's engine entry for bucket {entry.bucket} has no shapes for "
                             f"{batched[0] if batched else 'a batched input'}; rebuild with `trtc rebuild {directory}`")
        ranges.append((shapes.min[0], shapes.max[0]))
    largest = max(high for _, high in ranges)
    missing = [b for b in range(1, largest + 1) if not any(low <= b <= high for low, high in ranges)]
    if missing:
        taken = ", ".join(f"{low}" if low == high else f"{low}-{high}" for low, high in sorted(ranges))
        raise InputError(f"Triton's dynamic batcher sends any batch from 1 to {largest} without padding, but the "
                         f"profiles of {files[0]} take batches {taken} only (e.g. not {missing[0]}); build profiles "
                         "whose batch ranges cover 1 to the largest bucket, or export with --platform trtc "
                         "(which pads)")
    profiles = tuple(sorted({e.profile for e in entries}))
    from compiler.core.manifest import verified_file

    return verified_file(directory, entries[0], "engine"), profiles, largest


def plan_requirement(manifest: Manifest) -> tuple[str, str]:
    """(TensorRT version, one line saying which Triton can load the plan and on which GPUs) for a directory's
    engines, by the rules of ``compiler.backends.tensorrt.compat``."""
    env = dict(manifest.environment or {})
    version = str(env.get("tensorrt") or "unknown")
    gpus = gpus_that_run(env, manifest.hardware_compat)
    if manifest.version_compatible:
        return version, (f"model.plan was built version-compatible with TensorRT {version}: Triton loads it with "
                         f"{later_runtimes(version)} when started with "
                         f"--backend-config=tensorrt,version-compatible=true; {gpus}")
    return version, (f"model.plan was built with TensorRT {version}: Triton loads it only if its TensorRT is "
                     f"exactly {version} (pick the Triton container that ships it), or rebuild with "
                     f"--version-compatible; {gpus}")


def default_python_path() -> tuple[str, ...]:
    """The folders a ``trtc`` entry's model imports from: the one holding the ``compiler`` package that runs now,
    then the folders of ``PYTHONPATH`` (packages this process imports from there, an ONNX Runtime build among them,
    are the ones the model imports: Triton's server starts without ``PYTHONPATH``), then this interpreter's
    site-packages (``.pth`` files in them are not processed, so an editable install of another checkout cannot take
    the place of the first folder)."""
    folders = [str(Path(__file__).resolve().parents[2])]  # compiler/pipeline/triton.py -> the folder of compiler/
    paths = sysconfig.get_paths()
    from_env = [str(Path(f).resolve()) for f in os.environ.get("PYTHONPATH", "").split(os.pathsep) if f]
    for folder in [*from_env, paths["purelib"], paths["platlib"], *site.getsitepackages()]:
        if folder not in folders and Path(folder).is_dir():
            folders.append(folder)
    return tuple(folders)


def _refuse_unfaithful_onnx(onnx_path: Path, manifest: Manifest) -> None:
    """Refuse the ONNX Runtime variant of a graph that ONNX Runtime runs correctly only with transformers switched off
    by name (FP8 Q/DQ, INT4 weights: ``SESSION_POLICY``): Triton's onnxruntime backend sets optimization levels only,
    and at every level but none it fails or changes these graphs."""
    from compiler.core.onnx_io import session_rules

    # by name: Q/DQ's own rule (run as written) is about the CPU provider's fusions, which a GPU instance never runs;
    # FP16's keeps a layout pass off that changes no results
    rules = [rule for rule in session_rules(onnx_path) if rule.disabled_optimizers and rule.changes_results]
    if rules:
        precision = manifest.precision
        raise InputError(f"the {precision} ONNX holds {rules[0].what}, which Triton's onnxruntime backend would run "
                         f"with {', '.join(rules[0].disabled_optimizers)} on (it cannot turn one off by name): "
                         "export the TensorRT plan (build the engines) or --platform trtc, whose runtime runs it with "
                         "trtc's session options")


def build_files(directory: Path, manifest: Manifest) -> list[str]:
    """The relative paths a ``trtc`` entry's copy of ``directory`` holds: the manifest and every file it names
    (``Manifest.named_files``: ONNX files of each precision with their data, engines, layer files, the source
    model snapshot)."""
    from compiler.core.files import inside
    from compiler.core.manifest import MANIFEST

    unique = list(dict.fromkeys([MANIFEST, *(name for _, name in manifest.named_files())]))
    for name in unique:
        inside(directory, name)  # read_manifest checked these; a copy must never reach outside the directory
    return unique


def _choose_platform(directory: Path, manifest: Manifest,
                     platform: str) -> tuple[str, tuple[Path, tuple[int, ...], int] | None]:
    """(platform, the plan for tensorrt_plan) for ``platform`` as asked; ``auto`` logs why it picks trtc."""
    if platform in (ORT_ONNX, TRTC):
        return platform, None
    try:
        return TRT_PLAN, _plan_for_triton(directory, manifest)
    except InputError as err:
        if platform == TRT_PLAN:
            raise
        if not manifest.engines:
            return ORT_ONNX, None
        log.warning("writing the trtc platform (Triton's Python backend running trtc's runtime, which pads each "
                    "batch to its bucket): Triton's TensorRT backend cannot serve these engines: %s", err)
        return TRTC, None


def triton_repository(directory: str | Path, repo: str | Path, *, name: str | None = None, platform: str = "auto",
                      instances: int = 1, max_wait_ms: float = defaults.MAX_WAIT_MS, force: bool = False,
                      serving_backend: str = "auto", python_path: tuple[str, ...] | None = None,
                      preferred_batch_sizes: tuple[int, ...] | None = None) -> Path:
    """Write ``repo/NAME`` (config.pbtxt and version 1) for Triton; returns that folder.

    ``platform``: ``tensorrt_plan`` (the plan; InputError when Triton's TensorRT backend could not serve it),
    ``onnxruntime_onnx``, ``trtc`` (Triton's Python backend running ``compiler.load`` on a copy of the
    directory), or ``auto`` (the plan where it fits, else ``trtc`` for a directory with engines, logged
    with the reason, else ``onnxruntime_onnx``). ``max_batch_size`` is the largest bucket (the plan's largest
    profile), for ``trtc`` ``TRTC_MAX_BATCH_FACTOR`` times it. ``instances``: per GPU (or on the CPU). ``max_wait_ms``:
    Triton's ``max_queue_delay``. For ``trtc``: ``serving_backend`` is ``compiler.load``'s backend in the
    model, ``python_path`` the folders its code is imported from (default ``default_python_path()``).
    ``preferred_batch_sizes``: batches Triton runs as soon as it can form them (default: the buckets up to
    ``max_batch_size``; with 1 among them a request never waits for company, and a queue of n requests
    is run as the largest preferred size up to n).
    ``name`` defaults to the directory's name. An existing ``repo/NAME`` is replaced only with ``force``;
    the new folder appears whole (staged beside ``repo``, then renamed).
    """
    from compiler.core.files import require_directory
    from compiler.core.manifest import read_manifest
    from compiler.core.onnx_io import onnx_files
    from compiler.serve.triton_model import BUILD_FOLDER, MODEL_PY, PYTHON_PATH, SERVING_BACKEND, verify_files

    directory = Path(directory)
    repo = Path(repo)
    if platform not in PLATFORM_CHOICES:
        raise InputError(f"--platform {platform!r}: use one of {', '.join(PLATFORM_CHOICES)}")
    if serving_backend not in SERVING_BACKENDS:
        raise InputError(f"serving backend {serving_backend!r}: use one of {', '.join(SERVING_BACKENDS)}")
    if instances < 1:
        raise InputError(f"--instances {instances}: Triton needs at least one instance")
    if max_wait_ms < 0:
        raise InputError(f"--max-wait-ms {max_wait_ms:g}: a wait cannot be negative")
    manifest = read_manifest(directory)
    spec = manifest.spec
    name = name or directory.resolve().name
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        raise InputError(f"model name {name!r}: Triton takes the folder name as the model name; pass --name NAME "
                         "without slashes or a leading dot")
    onnx_path = manifest.onnx_for(directory)
    chosen, plan = _choose_platform(directory, manifest, platform)
    if chosen == ORT_ONNX:
        _refuse_unfaithful_onnx(onnx_path, manifest)
    inputs, outputs = _io_tensors(onnx_path, spec)
    buckets = tuple(sorted(manifest.buckets))
    max_batch = plan[2] if plan else max(buckets) * (TRTC_MAX_BATCH_FACTOR if chosen == TRTC else 1)
    if preferred_batch_sizes and max(preferred_batch_sizes) > max_batch:
        raise InputError(f"--preferred-batch-sizes {','.join(map(str, preferred_batch_sizes))}: Triton forms batches "
                         f"of at most max_batch_size {max_batch} here; use sizes up to {max_batch}")
    parameters: tuple[tuple[str, str], ...] = ()
    if chosen == TRTC:
        verify_files(directory, manifest)  # the copy is checked again when Triton loads it
        folders = python_path if python_path is not None else default_python_path()
        parameters = ((PYTHON_PATH, os.pathsep.join(folders)), (SERVING_BACKEND, serving_backend))
    model = TritonModel(name=name, platform=chosen, max_batch_size=max_batch, inputs=inputs, outputs=outputs,
                        preferred_batch_sizes=preferred_batch_sizes if preferred_batch_sizes is not None
                        else tuple(b for b in buckets if b <= max_batch),
                        max_queue_delay_us=round(max_wait_ms * 1000), instances=instances,
                        kind="KIND_GPU" if chosen == TRT_PLAN else "KIND_AUTO",
                        profiles=plan[1] if plan else (), parameters=parameters)
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
            shutil.copyfile(plan[0], version / MODEL_FILES[TRT_PLAN])
            trt_version, requirement = plan_requirement(manifest)
            (version / PLAN_VERSION_FILE).write_text(f"{trt_version}\n{requirement}\n")
            log.info("%s", requirement)
        elif chosen == ORT_ONNX:
            graph, *data = onnx_files(onnx_path)
            shutil.copyfile(graph, version / MODEL_FILES[ORT_ONNX])
            for path in data:  # external data keeps the name the graph refers to
                shutil.copyfile(path, version / path.relative_to(onnx_path.parent))
        else:
            for relative in build_files(directory, manifest):
                (version / BUILD_FOLDER / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(directory / relative, version / BUILD_FOLDER / relative)
            (version / MODEL_FILES[TRTC]).write_text(MODEL_PY)
        (stage / name / "config.pbtxt").write_text(model_config_text(model))
        _replace(stage / name, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s for Triton (%s, max batch %d)", target, chosen, max_batch)
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
