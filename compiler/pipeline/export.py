"""The stages chained into output directories: ``export_directory`` (more stages in build.py).

Every command writes into a staging folder inside the output directory and moves the
results into place only when everything succeeded, manifest last; a failed or killed run
leaves the previous contents as they were.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compiler.core.errors import InputError
from compiler.core.files import Transaction, atomic_write_json, directory_transaction, sha256_file, space_for
from compiler.core.manifest import (
    MANIFEST,
    FileRecord,
    Manifest,
    SourceRecord,
    now,
    refuse_foreign_directory,
    refuse_other_model,
    tool_versions,
    write_manifest,
)
from compiler.core.onnx_io import save_onnx, warm_checking_providers_beside
from compiler.core.progress import StageTimes, recording_stages, stage_timer
from compiler.core.settings import ExportSettings
from compiler.core.specs import BATCH_DIM, ModelSpec
from compiler.frontend.example_data import example_feeds
from compiler.frontend.export import ExportResult, onnx_from_torch
from compiler.frontend.loading import (
    LoadedModel,
    load_model,
    onnx_input_spec,
    snapshot_into,
    specs_from_exported_program,
)
from compiler.frontend.passes import run_passes_unchecked
from compiler.frontend.verify import ExportChecks, FeedSource

__all__ = ["export_directory", "ModelToExport", "model_to_export", "export_step", "exported_into",
           "source_fingerprint", "resolve_spec", "spec_is_complete", "refuse_oversized_buckets", "proto_bytes",
           "write_timing", "TIMING_JSON"]

log = logging.getLogger(__name__)

FP32_ONNX = "model.onnx"


def source_fingerprint(loaded: LoadedModel) -> str:
    """sha256 of the model file; for a factory, of its weights file or else of its state dict."""
    if loaded.source is not None:
        return sha256_file(loaded.source)
    import torch

    h = hashlib.sha256()
    for name, tensor in loaded.module.state_dict().items():
        h.update(name.encode())
        values = tensor.detach().cpu().contiguous()
        if values.dtype in (torch.bfloat16,) or values.dtype.is_complex:  # no numpy dtype: the same bytes as uint8
            values = values.reshape(-1).view(torch.uint8)
        h.update(values.numpy())  # the buffer itself, not a copy of it (tobytes() copied every weight once more)
    return h.hexdigest()


def spec_is_complete(settings: ExportSettings) -> bool:
    """Whether ``settings.spec`` (``--input``) is the model's whole input spec before the model is read: true for
    PyTorch models; an ONNX file's inputs are merged with what the file declares."""
    path = settings.source.path
    return settings.spec is not None and (bool(settings.source.factory) or (path is not None
                                                                         and path.suffix.lower() != ".onnx"))


def resolve_spec(loaded: LoadedModel, spec: ModelSpec | None) -> ModelSpec:
    """The model's input spec: ``spec`` (``--input``) for a PyTorch model, read off an ExportedProgram without one;
    for an ONNX file, ``spec``'s inputs and the others as the file declares them (``onnx_input_spec``)."""
    if loaded.is_onnx and loaded.onnx_path is not None:
        from compiler.core.onnx_io import load_onnx

        return onnx_input_spec(load_onnx(loaded.onnx_path, load_weights=False), spec)
    if spec is not None:
        return spec
    if loaded.exported_program is not None:
        inputs, dims = specs_from_exported_program(loaded.exported_program)
        return ModelSpec(tuple(inputs), dims)
    raise InputError("no input shapes given: pass --input NAME:SHAPE[:DTYPE] for each input, e.g. "
                     "--input images:Bx3x224x224:float32 (or set model.inputs in the profile)")


@dataclass
class ModelToExport:
    """The loaded model, its input spec and its fingerprint: what the export step starts from."""

    loaded: LoadedModel
    spec: ModelSpec
    fingerprint: str


def model_to_export(settings: ExportSettings, buckets: tuple[int, ...] | None = None) -> ModelToExport:
    """Load ``settings.source`` and resolve its spec, before any directory is locked (bad input fails first).

    With ``buckets`` (``trtc build``), they and the dim ranges are checked against what the model declares.
    """
    with stage_timer("model loading"):
        loaded = load_model(settings.source.path, factory=settings.source.factory, weights=settings.source.weights,
                            trust_pickle=settings.source.trust_pickle)
        spec = resolve_spec(loaded, settings.spec)
        if buckets is not None:
            check_against_model(loaded, spec, buckets)
    with stage_timer("model fingerprint"):
        fingerprint = source_fingerprint(loaded)
    return ModelToExport(loaded, spec, fingerprint)


def export_step(transaction: Transaction, model: ModelToExport, settings: ExportSettings,
                feeds: FeedSource | None = None, feeds_from: str = "",
                fp32_written: Callable[[Path], None] | None = None) -> Manifest:
    """The export step of ``trtc export`` and ``trtc build``: refuse a directory that holds another model's build
    (unless ``settings.force``), then export, fold and verify into the transaction's stage. Returns the manifest
    (not yet written); ``feeds``/``feeds_from``/``fp32_written`` as for ``exported_into``, ``feeds`` replaced by
    ``settings.example_data`` where that is given."""
    if settings.example_data is not None:
        feeds, feeds_from = example_feeds(settings.example_data, model.spec)
    refuse_other_model(transaction.directory, model.fingerprint, settings.force)
    return exported_into(transaction.stage, model.loaded, model.spec, settings, model.fingerprint, feeds, feeds_from,
                         fp32_written)


def export_directory(settings: ExportSettings, command: str = "trtc export") -> Manifest:
    """Load, export, run the passes, verify and write ``OUT/model.onnx`` and ``OUT/manifest.json``."""
    with recording_stages() as times:
        with stage_timer("checks before export"):
            refuse_foreign_directory(settings.out, settings.force, ("failed",))
            if settings.spec is not None and spec_is_complete(settings):
                refuse_oversized_buckets(settings.spec, settings.buckets)
        model = model_to_export(settings)
        refuse_oversized_buckets(model.spec, settings.buckets)
        if any(BATCH_DIM not in i.dims for i in model.spec.inputs):
            log.warning("an input has no batch dimension B; batching applies only to inputs that have one")
        with directory_transaction(settings.out, command) as transaction:
            manifest = export_step(transaction, model, settings)
            write_timing(transaction.stage, command, times)
            write_manifest(transaction.stage / MANIFEST, manifest)
    return manifest


TIMING_JSON = "report/timing.json"


def write_timing(stage: Path, command: str, times: StageTimes) -> None:
    """``report/timing.json`` into ``stage``: every stage of the command so far with its seconds, the process's
    seconds and what no stage holds (``StageTimes.to_dict``); written last before the manifest."""
    atomic_write_json(stage / TIMING_JSON, {"command": command, **times.to_dict()})


def exported_into(stage: Path, loaded: LoadedModel, spec: ModelSpec, settings: ExportSettings,
                  fingerprint: str, feeds: FeedSource | None = None, feeds_from: str = "",
                  fp32_written: Callable[[Path], None] | None = None) -> Manifest:
    """Export and verify into ``stage``; returns the manifest (not yet written).

    ``feeds`` gives the example inputs at a batch size (``feeds_from`` says whence, for the
    manifest); by default seeded values from the spec (``ModelSpec.example_feed``). ``fp32_written(path)`` is
    called once ``stage/model.onnx`` is written, before the export and pass checks run: ``trtc build`` starts
    the calibration there, beside the checks (a check that fails then raises here, and the caller abandons it).
    """
    work = stage / ".export"
    work.mkdir()
    warm_checking_providers_beside()  # the checks' ONNX Runtime session comes after the export
    with stage_timer("export"):
        result: ExportResult = onnx_from_torch(loaded, spec, settings.max_batch, settings.opset,
                                               list(settings.output_names) or None, work, feeds)
    raw = result.model
    exported = {"exporter": result.exporter, "opset": result.opset, "seconds": round(result.seconds, 3),
                "fallback_reason": result.fallback_reason}
    del result  # ``raw`` is the one reference to the exported proto: dropped once the passes no longer need it
    # on the GPU where there is one (TF32 off on both sides), judged on the CPU if a GPU check fails
    with stage_timer("export check setup"):
        checks = ExportChecks(loaded.module, spec.input_names, [o.name for o in raw.graph.output])
    tol = settings.tolerance
    verification: dict[str, Any] = {"rtol": tol.rtol, "atol": tol.atol, "min_cosine": tol.min_cosine,
                                    "batches": settings.verify_batches,
                                    "inputs": feeds_from if feeds is not None else "example values of the spec"}
    # the export as it came, in a file: what the export check runs against eager PyTorch (the passes change the
    # proto in place) or, for an ONNX input, the reference of the pass check (the user's own file)
    user_file = loaded.onnx_path if loaded.is_onnx else None
    exported_path = user_file or work / "exported.onnx"
    if user_file is None:
        with stage_timer("writing the exported ONNX"), space_for(stage, proto_bytes(raw)):
            save_onnx(raw, exported_path)
    start = time.perf_counter()
    with stage_timer("graph passes"):
        folded, passes = run_passes_unchecked(raw)  # checked below, as the export check is
    del raw  # from here on the model lives in files: each copy held in memory was the weights once more
    passes_seconds = time.perf_counter() - start
    onnx_path = stage / FP32_ONNX
    with stage_timer(f"writing {FP32_ONNX}"), space_for(stage, proto_bytes(folded)):
        save_onnx(folded, onnx_path)
    output_names = [o.name for o in folded.graph.output]
    del folded
    if fp32_written is not None:
        fp32_written(onnx_path)
    # the file's digest and the source snapshot are written and read beside the checks, which only read the
    # module and the files (hashing and file writes release the GIL): 0.9 s of a ViT-B/16's build on an H200 host
    with ThreadPoolExecutor(2, thread_name_prefix="trtc-beside-checks") as pool:
        digest = pool.submit(FileRecord.for_onnx, stage, onnx_path)
        snapshotted = pool.submit(_snapshot, stage, loaded)
        if checks.eager is not None:
            with stage_timer("export check"):
                verification["export"] = [c.to_dict() for c in checks.run(
                    exported_path, None, spec, settings.verify_batches, tol,
                    "export check (ONNX Runtime vs eager PyTorch)", feeds=feeds, feeds_from=feeds_from)]
        with stage_timer("pass check"):
            verification["passes"] = [c.to_dict() for c in checks.run(
                onnx_path, None if checks.eager is not None else exported_path, spec, settings.verify_batches, tol,
                "pass check (folded ONNX vs reference)", feeds=feeds, feeds_from=feeds_from)]
        verification["reference"] = checks.reference_name
        verification["devices"] = checks.record()  # where the checks ran, as calibration records its provider
        with stage_timer("export cleanup"):
            checks.close()
            shutil.rmtree(work)
        with stage_timer("source snapshot"):
            snapshot = snapshotted.result()
        with stage_timer(f"{FP32_ONNX} digest"):
            record = digest.result()
    source = SourceRecord(settings.source.describe(), loaded.format, fingerprint, settings.source.factory or None,
                          snapshot)
    return Manifest(
        trtc_version=tool_versions()["trtc"],
        created=now(),
        tools=tool_versions(),
        source=source,
        inputs=tuple(str(i) for i in spec.inputs),
        dims={name: str(r) for name, r in spec.dims.items()},
        output_names=tuple(output_names),
        buckets=tuple(settings.buckets),
        export={**exported, "passes_seconds": round(passes_seconds, 3)},
        passes=tuple(asdict(p) for p in passes),
        verification=verification,
        onnx={"fp32": record},
        precision="fp32",
    )


def _snapshot(stage: Path, loaded: LoadedModel) -> FileRecord | None:
    with space_for(stage, 0):
        return snapshot_into(stage, loaded)


def proto_bytes(model: Any) -> int:
    """About how many bytes an ONNX model takes on disk: its initializers' data (in the proto or counted by their
    external ``length``) and a little for the graph."""
    total = 0
    for tensor in model.graph.initializer:
        length = next((int(e.value) for e in tensor.external_data if e.key == "length"), 0)
        total += length or len(tensor.raw_data) or 4 * max(len(tensor.float_data), len(tensor.int64_data) * 2)
    return total + (1 << 16) + 256 * len(model.graph.node)


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size / 4:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def refuse_oversized_buckets(spec: ModelSpec, buckets: tuple[int, ...]) -> None:
    """InputError (before any export) when the largest bucket's inputs alone, at the max of every dynamic dim, take
    more bytes than this machine has available: the export check runs that batch in memory."""
    from compiler.core.capabilities import available_memory

    largest, per_sample, available = max(buckets), spec.sample_bytes(), available_memory()
    if available is None or per_sample == 0 or largest * per_sample <= available:
        return
    fits = max(1, available // per_sample)
    raise InputError(f"--buckets {largest}: a batch of {largest} holds {_gib(largest * per_sample)} of inputs "
                     f"({_gib(per_sample)} a sample), more than the {_gib(available)} of memory available here, and "
                     f"the export is checked at the largest bucket; use buckets of at most {fits}")


def check_against_model(loaded: LoadedModel, spec: ModelSpec, buckets: tuple[int, ...]) -> None:
    """Buckets and dim ranges must fit what the model itself declares (ExportedProgram ranges, fixed ONNX dims)."""
    if loaded.exported_program is not None:
        from compiler.frontend.loading import program_ranges

        for name, (lo, hi) in program_ranges(loaded.exported_program).items():
            if name == BATCH_DIM and hi is not None and max(buckets) > hi:
                raise InputError(f"bucket {max(buckets)} is larger than the model allows: its ExportedProgram "
                                 f"declares batch <= {hi}; lower --buckets or export with a larger batch range")
            if name in spec.dims and (spec.dims[name].min < lo or (hi is not None and spec.dims[name].max > hi)):
                raise InputError(f"--dim {name}={spec.dims[name]} contradicts the model, which declares {name} in "
                                 f"[{lo}, {hi if hi is not None else 'inf'}]; fix the range in the profile or --dim")
    if loaded.is_onnx and loaded.onnx_path is not None:
        from compiler.core.onnx_io import load_onnx

        graph = load_onnx(loaded.onnx_path, load_weights=False).graph
        for inp in graph.input:
            dims = inp.type.tensor_type.shape.dim
            want = next((s for s in spec.inputs if s.name == inp.name), None)
            if want and dims and want.dims and want.dims[0] == BATCH_DIM and dims[0].dim_value:
                fixed = dims[0].dim_value
                if fixed not in (max(buckets),) or len(buckets) > 1:
                    raise InputError(f"the ONNX input {inp.name} has a fixed batch of {fixed}, so buckets "
                                     f"{','.join(map(str, buckets))} cannot be built; re-export with a dynamic batch")
