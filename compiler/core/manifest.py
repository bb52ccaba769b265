"""``DIR/manifest.json``, what a build directory holds and how it was made, as a typed ``Manifest``.

The one reader and writer of the file: ``read_manifest`` checks it (schema version, the shape of every key a
command reads, paths confined to the directory) and returns a ``Manifest``; ``write_manifest`` writes one.
Commands change a manifest only through its update methods (``with_calibration``, ``with_engines``,
``with_no_engines``, ``rebuilt``, ``merged``), and readers share its rules (``spec``, ``tf32``, ``onnx_for``,
``engine_precision``). Each key of docs/manifest.md is a field of the same name; records that code reads are typed
(``FileRecord``, ``EngineRecord``, ``SourceRecord``, ``BuildSettings``), those written for people (``export``,
``verification``, ``accuracy``, ...) stay the JSON they are, and keys of a newer trtc are kept in ``extra``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Self

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.files import atomic_write_json, inside, read_json, sha256_file, sha256_files
from compiler.core.manifest_shape import malformed
from compiler.core.onnx_io import onnx_files
from compiler.core.settings import BuildSettings, hardware_compat_level
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.core.version import __version__

__all__ = ["SCHEMA_VERSION", "MANIFEST", "Manifest", "FileRecord", "EngineRecord", "SourceRecord", "ShapeRange",
           "CalibrationRecord", "read_manifest", "write_manifest", "settings_to_dict", "settings_from_dict",
           "recorded_tf32", "tool_versions", "refuse_other_model", "refuse_foreign_directory", "now", "verified_onnx",
           "verified_file"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED = {  # keys every manifest has from its export on, and what each holds; read_manifest refuses one without
    "buckets": "the batch buckets", "onnx": "the ONNX files and their sha256"}  # (no inputs: a model without any)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def tool_versions() -> dict[str, str]:
    versions = {"trtc": __version__, "python": platform.python_version()}
    for name in ("torch", "onnx", "onnxruntime", "polygraphy", "onnx_graphsurgeon"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        versions[name] = getattr(module, "__version__", "?")
    return versions


# --- records ---------------------------------------------------------------------------------------------------------

def _json(value: Any) -> Any:
    """A field's value as JSON: records by their ``to_json``, tuples as lists, a copy of anything else."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json(v) for k, v in value.items()}
    return copy.deepcopy(value)


class _Record:
    """A JSON object of the manifest as a frozen dataclass: a field per key, read through ``_CONVERT`` (else
    copied); ``extra`` holds the keys this trtc does not know, so that writing the record back loses nothing."""

    _CONVERT: ClassVar[Mapping[str, Any]] = {}
    _NOT_KEYS: ClassVar[tuple[str, ...]] = ("extra",)  # fields that are no key of the JSON
    extra: Mapping[str, Any]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        names = [f.name for f in dataclasses.fields(cls) if f.name not in cls._NOT_KEYS]  # type: ignore[arg-type]
        values = {n: cls._CONVERT.get(n, copy.deepcopy)(data[n]) for n in names if data.get(n) is not None}
        make: Any = cls
        return make(**values, extra={k: copy.deepcopy(v) for k, v in data.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        """The record as JSON: its fields in order, those without a value (None, empty) left out, then ``extra``."""
        names = [f.name for f in dataclasses.fields(self) if f.name not in self._NOT_KEYS]  # type: ignore[arg-type]
        values = {name: getattr(self, name) for name in names}
        return {**{k: _json(v) for k, v in values.items() if v not in (None, "", (), {})},
                **copy.deepcopy(dict(self.extra))}


@dataclass(frozen=True)
class FileRecord(_Record):
    """A file of the directory and its digest: an ONNX graph with its data files (``files``, graph first; ``sha256``
    over all of them in that order), or one file (the source snapshot: ``files`` empty). ``bytes``: their size."""

    file: str
    sha256: str
    files: tuple[str, ...] = ()
    bytes: int | None = None
    file_sha256: Mapping[str, str] = field(default_factory=dict)  # each of ``files`` by its own sha256
    extra: Mapping[str, Any] = field(default_factory=dict)
    _CONVERT: ClassVar[Mapping[str, Any]] = {"files": tuple}

    @property
    def names(self) -> tuple[str, ...]:
        """Every file of the record, relative to the directory: ``files``, else the one ``file``."""
        return self.files or (self.file,)

    @classmethod
    def for_onnx(cls, directory: Path, path: Path) -> FileRecord:
        """The record of the ONNX graph ``path`` inside ``directory`` and its external data: one digest for all."""
        found = onnx_files(path)
        names = tuple(f.relative_to(directory).as_posix() for f in found)
        digests = [sha256_file(f) for f in found]  # each file read once: the record's digest is made of these
        return cls(names[0], sha256_files(found, digests), names, sum(f.stat().st_size for f in found),
                   dict(zip(names, digests)))

    @classmethod
    def for_file(cls, directory: Path, path: Path) -> FileRecord:
        """The record of one file ``path`` inside ``directory``."""
        return cls(path.relative_to(directory).as_posix(), sha256_file(path), bytes=path.stat().st_size)


@dataclass(frozen=True)
class ShapeRange:
    """The min / opt / max shape of one input in an engine's optimization profile."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_json(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class EngineRecord(_Record):
    """One bucket's engine: its file (shared by the buckets of a multi-profile engine, each with its ``profile``),
    digest and size, the ``shapes`` it was built for, ``build_seconds``, ``layers`` (TensorRT's layer information:
    ``file``, ``count``, ``output_types``) and the ONNX it was built from (``onnx``, ``onnx_sha256``)."""

    bucket: int
    file: str
    sha256: str
    profile: int = 0
    bytes: int | None = None
    shapes: Mapping[str, ShapeRange] = field(default_factory=dict)
    build_seconds: float | None = None
    layers: Mapping[str, Any] | None = None
    onnx: str | None = None
    onnx_sha256: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    _CONVERT: ClassVar[Mapping[str, Any]] = {"shapes": lambda shapes: {
        name: ShapeRange(tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])) for name, s in shapes.items()}}

    @property
    def names(self) -> tuple[str, ...]:
        """The files of this engine, relative to the directory: the engine and its layer file."""
        layers = (self.layers or {}).get("file")
        return (self.file, layers) if isinstance(layers, str) and layers else (self.file,)


@dataclass(frozen=True)
class SourceRecord(_Record):
    """The model the directory was exported from: ``path`` (the file, or the factory), ``format``
    (``exported_program``, ``torchscript``, ``onnx``, ``factory`` or ``pickle``), ``sha256`` of the model file (of
    the state dict for a factory without weights), ``factory``, and ``snapshot``: the copy kept in ``DIR/source/``
    (None for an ONNX input). An empty string is a key the record lacks."""

    path: str = ""
    format: str = ""
    sha256: str = ""
    factory: str | None = None
    snapshot: FileRecord | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    _CONVERT: ClassVar[Mapping[str, Any]] = {"snapshot": FileRecord.from_json}


@dataclass(frozen=True)
class CalibrationRecord:
    """What a calibration that passed adds to the manifest (``Manifest.with_calibration``): the reduced-precision
    ONNX, the gate's ``accuracy`` and the ``data`` entries of this precision, and the section of its kind
    (``calibration`` for INT8, ``fp16`` for FP16, ``fp8`` and ``int4`` for theirs)."""

    precision: str
    onnx: FileRecord
    accuracy: Mapping[str, Any]
    data: Mapping[str, Any]
    calibration: Mapping[str, Any] | None = None
    fp16: Mapping[str, Any] | None = None
    fp8: Mapping[str, Any] | None = None
    int4: Mapping[str, Any] | None = None


# --- build settings as the manifest stores them --------------------------------------------------------------------

def settings_to_dict(settings: BuildSettings) -> dict[str, Any]:
    """``BuildSettings`` as the manifest's ``build``: JSON values (lists, strings) under the field names."""
    out = dataclasses.asdict(settings)
    out["buckets"] = list(settings.buckets)
    out["timing_cache"] = str(settings.timing_cache) if settings.timing_cache is not None else None
    return out


def recorded_tf32(build: Mapping[str, Any] | None) -> bool:
    """Whether FP32 math may use TF32 for a recorded ``build`` section: its ``tf32``; a section without one (a trtc
    that did not record it) built with TF32 off; no section: the default. One rule for ``trtc rebuild`` and the
    serving and bench backends (``Manifest.tf32``)."""
    if not isinstance(build, Mapping):
        return defaults.TF32
    return bool(build.get("tf32", False))


def settings_from_dict(data: Mapping[str, Any]) -> BuildSettings:
    """``BuildSettings`` from the manifest's ``build``; keys this trtc does not know are not used (with a note; a
    ``Manifest`` keeps them in ``build_extra`` and writes them back)."""
    known = {f.name for f in dataclasses.fields(BuildSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        log.info("manifest build settings %s are unknown to this trtc: not used", ", ".join(unknown))
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


# --- the manifest ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Manifest(_Record):
    """``DIR/manifest.json``: one field per key of docs/manifest.md (which says what writes each), ``extra`` for keys
    this trtc does not know. ``from_json`` / ``to_json`` convert the JSON object both ways and lose no key; the JSON
    records of people (``export``, ``verification``, ...) are kept as they are, and not to be changed in place."""

    trtc_version: str | None = None
    created: str | None = None
    tools: Mapping[str, str] | None = None
    source: SourceRecord | None = None
    inputs: tuple[str, ...] = ()  # the input spec: NAME:SHAPE:DTYPE each (``spec``)
    dims: Mapping[str, str] = field(default_factory=dict)  # non-batch dynamic dims: {NAME: "MIN:OPT:MAX"}
    output_names: tuple[str, ...] = ()
    buckets: tuple[int, ...] = ()  # the batch buckets the export was verified for
    export: Mapping[str, Any] | None = None
    passes: Sequence[Mapping[str, Any]] | None = None
    verification: Mapping[str, Any] | None = None
    onnx: Mapping[str, FileRecord] = field(default_factory=dict)  # by precision: fp32, int8, fp16, ...
    precision: str = defaults.PRECISION  # the precision last produced (engines record theirs in build.precision)
    calibration: Mapping[str, Any] | None = None
    fp16: Mapping[str, Any] | None = None
    fp8: Mapping[str, Any] | None = None  # as calibration, for FP8
    int4: Mapping[str, Any] | None = None  # INT4 weight-only: block, method, layers, sizes
    data: Mapping[str, Any] | None = None
    accuracy: Mapping[str, Any] | None = None
    build: BuildSettings | None = None  # None: never built
    engines: tuple[EngineRecord, ...] = ()
    engines_note: str | None = None  # why no engines were built
    environment: Mapping[str, Any] | None = None  # where the engines were built (backends.tensorrt.environment)
    build_seconds: float | None = None
    engines_built: str | None = None
    merged_from: Sequence[str] | None = None
    failed: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys of a newer trtc, written back as they were
    build_extra: Mapping[str, Any] = field(default_factory=dict)  # the same, inside ``build``

    # --- JSON ------------------------------------------------------------------------------------------------------

    _CONVERT: ClassVar[Mapping[str, Any]] = {
        "source": SourceRecord.from_json, "inputs": tuple, "output_names": tuple, "buckets": tuple,
        "build": settings_from_dict, "onnx": lambda records: {p: FileRecord.from_json(r) for p, r in records.items()},
        "engines": lambda records: tuple(EngineRecord.from_json(r) for r in records)}
    _NOT_KEYS: ClassVar[tuple[str, ...]] = ("extra", "build_extra")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """The manifest of a JSON object (``schema_version`` aside, which ``read_manifest`` checks). InputError when a
        key has the wrong shape or the build settings do not parse."""
        problem = malformed(data)
        if problem:
            raise InputError(f"{problem}; the manifest is damaged, rebuild the directory with `trtc build`")
        build = data.get("build") or {}  # an empty build section records nothing
        keys = {k: v for k, v in data.items() if k != "schema_version" and (k != "build" or build)}
        known = {f.name for f in dataclasses.fields(BuildSettings)}
        return replace(super().from_json(keys),
                       build_extra={k: copy.deepcopy(v) for k, v in build.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``manifest.json``: ``schema_version`` first, then each key that has a value."""
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("extra", "build_extra") or value is None or (f.name in ("inputs", "buckets") and not value):
                continue
            if f.name == "engines" and not value and self.build is None:
                continue  # an export: no engines key until a build writes one
            if f.name == "build":
                out["build"] = {**settings_to_dict(value), **copy.deepcopy(dict(self.build_extra))}
            else:
                out[f.name] = _json(value)
        return {**out, **copy.deepcopy(dict(self.extra))}

    # --- what readers need -----------------------------------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        """The input spec recorded by the export (``inputs`` and ``dims``)."""
        if not self.inputs:
            raise InputError("the manifest has no usable input spec (no inputs); re-export with `trtc export`")
        return ModelSpec(tuple(parse_input_spec(text) for text in self.inputs),
                         dict(parse_dim_range(f"{name}={text}") for name, text in self.dims.items()))

    @property
    def tf32(self) -> bool:
        """Whether FP32 math may use TF32, as the engines were built (``recorded_tf32``): the build's ``tf32``
        (False for a build section that does not record it), the default when nothing was built."""
        return self.build.tf32 if self.build is not None else defaults.TF32

    @property
    def hardware_compat(self) -> str:
        """The engines' hardware-compatibility level: the build's, else the environment's, else ``none``."""
        if self.build is not None:
            return self.build.hardware_compat
        return hardware_compat_level((self.environment or {}).get("hardware_compat"))

    @property
    def version_compatible(self) -> bool:
        """Whether the engines were built version-compatible: the build's setting, else the environment's."""
        if self.build is not None:
            return self.build.version_compatible
        return bool((self.environment or {}).get("version_compatible"))

    @property
    def accuracy_metrics(self) -> dict[str, str | None]:
        """The accuracy gate's metric (``top1`` or ``cosine``) per reduced precision; None where it did not run."""
        return {precision: entry.get("metric") if isinstance(entry, Mapping) else None
                for precision, entry in (self.accuracy or {}).items()}

    def engine_precision(self, engine: EngineRecord) -> str:
        """The precision of the ONNX ``engine`` was built from (its ``onnx`` file), else the build's precision."""
        for precision, record in self.onnx.items():
            if record.file == engine.onnx:
                return precision
        return self.build.precision if self.build is not None else self.precision

    def onnx_record(self, directory: Path, precision: str) -> FileRecord:
        """The ``onnx`` record of ``precision``; InputError naming the precisions there are when there is none."""
        if precision not in self.onnx:
            have = ", ".join(sorted(self.onnx)) or "none"
            raise InputError(f"{directory} has no {precision} ONNX (it has: {have}); run `trtc build` with "
                             f"--precision {precision}, or rebuild another precision")
        return self.onnx[precision]

    def onnx_for(self, directory: Path, precision: str | None = None) -> Path:
        """The graph of ``precision`` (default: the manifest's ``precision``) in ``directory``, confined to it and
        checked against its sha256 (``verified_onnx``)."""
        precision = precision or self.precision
        return verified_onnx(directory, self.onnx_record(directory, precision), precision)

    def rebuild_settings(self) -> BuildSettings:
        """The settings ``trtc rebuild`` repeats: the recorded build's; for an export never built, the export's
        buckets and precision with the default settings."""
        if self.build is not None:
            return self.build
        return BuildSettings(buckets=self.buckets or BuildSettings().buckets, precision=self.precision)

    def named_files(self) -> list[tuple[str, str]]:
        """(what, relative path) of every file the manifest names: ONNX and data files, engines and their layer
        files, the source snapshot."""
        paths = [(f"{precision} ONNX", name) for precision, record in self.onnx.items()
                 for name in dict.fromkeys((record.file, *record.names))]
        for engine in self.engines:
            paths += list(zip(("engine", "layer file"), engine.names))
        if self.source is not None and self.source.snapshot is not None:
            paths.append(("source model snapshot", self.source.snapshot.file))
        return paths

    # --- how the commands change it --------------------------------------------------------------------------------

    def with_calibration(self, record: CalibrationRecord) -> Manifest:
        """After a calibration that passed: its ONNX beside the others, ``precision`` the new one, its ``accuracy``
        and ``data`` entries beside the other precisions', its ``calibration``, ``fp16``, ``fp8`` or ``int4`` section
        over the old."""
        def over(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
            return old if new is None else {**(old or {}), **copy.deepcopy(dict(new))}

        return replace(self, onnx={**self.onnx, record.precision: record.onnx}, precision=record.precision,
                       accuracy=over(self.accuracy, {record.precision: record.accuracy}),
                       data=over(self.data, {record.precision: record.data}),
                       calibration=over(self.calibration, record.calibration), fp16=over(self.fp16, record.fp16),
                       fp8=over(self.fp8, record.fp8), int4=over(self.int4, record.int4))

    def with_engines(self, settings: BuildSettings, environment: Mapping[str, Any],
                     engines: Sequence[EngineRecord]) -> Manifest:
        """After an engine build: the ``build`` settings (so that ``trtc rebuild`` can repeat them), the
        ``environment`` the engines were built in with the settings' compatibility, and the ``engines``.
        ``engines_note`` goes once there are engines: it no longer describes the directory."""
        recorded = {**environment, "hardware_compat": settings.hardware_compat,
                    "version_compatible": settings.version_compatible}
        return replace(self, build=settings, build_extra={}, environment=recorded, engines=tuple(engines),
                       engines_note=None if engines else self.engines_note)

    def with_no_engines(self, settings: BuildSettings, note: str,
                        environment: Mapping[str, Any] | None = None) -> Manifest:
        """After a build that made no engines: the settings, why (``note``: ``not built: ...``) and, when it looked
        for TensorRT, the ``environment`` it found."""
        built = self.with_engines(settings, environment, ()) if environment is not None else replace(
            self, build=settings, build_extra={}, engines=())
        return replace(built, engines_note=note)

    def rebuilt(self, settings: BuildSettings, environment: Mapping[str, Any],
                engines: Sequence[EngineRecord]) -> Manifest:
        """After ``trtc rebuild``: as ``with_engines``, and ``engines_built`` now."""
        return replace(self.with_engines(settings, environment, engines), engines_built=now())

    def merged(self, reference: Manifest, engines: Sequence[EngineRecord], merged_from: Sequence[str]) -> Manifest:
        """After ``trtc merge``: ``engines`` (by bucket) from the directories ``merged_from``, with the build settings
        and environment of ``reference`` (the first directory with engines) and its buckets those of ``engines``."""
        build = replace(reference.build or BuildSettings(), buckets=tuple(sorted(e.bucket for e in engines)))
        return replace(self, build=build, build_extra=reference.build_extra, environment=reference.environment,
                       engines=tuple(sorted(engines, key=lambda e: e.bucket)), merged_from=list(merged_from))


# --- reading and writing ---------------------------------------------------------------------------------------------

def read_manifest(directory: Path) -> Manifest:
    """``directory``'s manifest, checked: one InputError (a line naming the file and the fix) for a missing,
    unreadable, other-version or damaged manifest, or one that names a path outside the directory."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise InputError(f"{directory}: no {MANIFEST}; run `trtc export` or `trtc build` into it first")
    try:
        data = read_json(path)
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not valid JSON ({err}); rebuild the directory with `trtc build --force`") from err
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise InputError(f"{path}: schema_version {version!r}, this trtc reads {SCHEMA_VERSION}; rebuild the "
                         "directory with this version of trtc")
    missing = next((key for key in REQUIRED if key not in data), None)
    if missing is not None:
        raise InputError(f"{path}: the key {missing!r} is missing ({REQUIRED[missing]}); the manifest is damaged: "
                         "restore it or rebuild the directory with `trtc build`")
    try:
        manifest = Manifest.from_json(data)
    except InputError as err:
        raise InputError(f"{path}: {err}") from err
    if manifest.precision not in manifest.onnx:
        raise InputError(f"{path}: 'onnx' has no entry for its precision {manifest.precision!r} (it has "
                         f"{', '.join(sorted(manifest.onnx)) or 'none'}); the manifest is damaged: restore it or "
                         "rebuild the directory with `trtc build`")
    for what, name in manifest.named_files():
        inside(Path(directory), name, what)
    return manifest


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write ``manifest`` to ``path`` (a staged ``manifest.json``) atomically."""
    atomic_write_json(path, manifest.to_json())


def refuse_other_model(directory: Path, source_sha256: str, force: bool) -> None:
    """Refuse to write over a directory that holds a different model's build, unless ``force``. Reads the old
    manifest leniently: one that does not read protects nothing."""
    path = directory / MANIFEST
    if force or not path.is_file():
        return
    try:
        old = read_json(path)
    except ValueError:
        return
    source = (old.get("source") if isinstance(old, dict) else None) or {}
    old_sha = source.get("sha256") if isinstance(source, dict) else None
    if old_sha and old_sha != source_sha256:
        raise InputError(f"{directory} holds the build of another model ({source.get('path')}); choose another --out "
                         "directory or pass --force to replace it")


def refuse_foreign_directory(directory: Path, force: bool, own: tuple[str, ...] = ()) -> None:
    """Refuse (InputError, one line) to write into an existing, non-empty ``directory`` that holds no trtc build
    (no ``manifest.json``): its files are the user's (a model.onnx of their own, say), which a build would replace.
    ``own`` names entries trtc leaves there itself (``failed``); the lock and staging folders never count.
    ``force`` writes anyway."""
    if force or not directory.is_dir() or (directory / MANIFEST).is_file():
        return
    theirs = sorted(p.name for p in directory.iterdir()
                    if p.name not in (*own, ".trtc.lock") and not p.name.startswith(".staging-"))
    if theirs:
        shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        raise InputError(f"{directory} is not empty and holds no trtc build (it has {shown}); choose a new or empty "
                         "--out directory, or pass --force to write into it (files of the same names are replaced)")


# --- files and digests -----------------------------------------------------------------------------------------------

def verified_file(directory: Path, record: FileRecord | EngineRecord, what: str = "file") -> Path:
    """The confined ``record.file`` after checking that it exists and matches ``record.sha256``."""
    path = inside(directory, record.file, what)
    if not path.is_file():
        raise InputError(f"{path} is missing: the directory is incomplete; rebuild it with `trtc rebuild {directory}`")
    if sha256_file(path) != record.sha256:
        raise InputError(f"{path} does not match the sha256 in {directory / MANIFEST} (changed or truncated); "
                         f"rebuild it with `trtc rebuild {directory}` or `trtc build`")
    return path


def verified_onnx(directory: Path, record: FileRecord | None, precision: str = "") -> Path:
    """The confined graph of an ``onnx`` record, after its files (graph + data) match the record's sha256.

    Every file is checked inside ``directory`` and read only after the digest over all of them
    matches; the graph's external data references are checked to be among those files.
    """
    what = f"{precision} ONNX".strip()
    if record is None:
        raise InputError(f"{directory / MANIFEST}: the {what} entry lacks file or sha256; rebuild the directory "
                         "with `trtc build`")
    names = list(record.names)
    if record.file not in names:
        raise InputError(f"{directory / MANIFEST}: the {what} entry's files do not include its graph; rebuild the "
                         "directory with `trtc build`")
    files = [inside(directory, name, what) for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{', '.join(missing)} missing: the directory's ONNX is incomplete; restore it or "
                         "re-run `trtc build`")
    graph = files[names.index(record.file)]
    digests = [sha256_file(f) for f in files]
    if sha256_files(files, digests) != record.sha256:
        changed = [str(f) for f, name, digest in zip(files, names, digests)
                   if record.file_sha256.get(name) not in (None, digest)]
        named = " or ".join(str(f) for f in files)  # a record of an older trtc: no digest per file
        what_changed = (f"{changed[0]} does not match the sha256 in the manifest" if changed else
                        f"{named} do not match the sha256 in the manifest" if len(files) > 1
                        else f"{graph} does not match the sha256 in the manifest")
        raise InputError(f"{what_changed}: it was changed after export, so the {what} is not the verified model; "
                         "restore it or re-run `trtc build` to re-export")
    referenced = {p.resolve() for p in onnx_files(graph)}
    if not referenced <= {f.resolve() for f in files}:
        raise InputError(f"{graph} refers to data files the manifest does not list; re-run `trtc build`")
    return graph
