"""``profiles/*.toml``: a model described once, so that ``trtc build --profile X`` is the CI command.

The schema (``SCHEMA``: section -> key -> (TOML types, meaning)) is derived from the settings dataclasses'
fields (``compiler.core.settings.profiled``), each meaning followed by the field's default. Relative paths in
a profile are relative to the profile file's directory. Every key is checked against the schema; errors
name the file, the key and what was expected. ``*_settings`` merge a profile with command-line options, the
command line first: the one place either becomes settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import tomllib

from compiler.core.errors import InputError
from compiler.core.settings import (
    BenchSettings,
    BuildSettings,
    CalibrationSettings,
    ExportSettings,
    GateSettings,
    ModelSource,
    ProfileKey,
)
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec

__all__ = ["SCHEMA", "PATH_KEYS", "load_profile", "export_settings", "calibration_settings", "build_settings",
           "bench_settings"]

Profile = Mapping[str, Mapping[str, Any]]
Options = Mapping[str, Any]
T = TypeVar("T")

# the settings whose fields a profile sets, in the order the schema (and docs/profiles.md) lists them
_PROFILED = (ModelSource, ExportSettings, CalibrationSettings, GateSettings, BuildSettings)
# keys whose values are paths, made absolute against the profile's folder ("random" data stays as it is)
PATH_KEYS = {("model", "source"), ("model", "weights"), ("calibration", "data"), ("calibration", "labels"),
             ("calibration", "eval_data"), ("build", "out"), ("build", "timing_cache")}


def _stated(default: Any) -> str:
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, tuple):
        return str(list(default))
    return str(default)


def _schema() -> dict[str, dict[str, tuple[tuple[type, ...], str]]]:
    schema: dict[str, dict[str, tuple[tuple[type, ...], str]]] = {}
    for cls in _PROFILED:
        for f in dataclasses.fields(cls):
            keys: tuple[ProfileKey, ...] = f.metadata.get("profile", ())
            for key in keys:
                meaning = key.meaning
                if "default" not in meaning and f.default not in (None, (), dataclasses.MISSING):
                    meaning += f" (default {_stated(f.default)})"
                schema.setdefault(key.section, {})[key.key] = (key.types, meaning)
    return {section: schema[section] for section in ("model", "export", "calibration", "build")}


SCHEMA = _schema()


def load_profile(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read and validate a profile; returns {section: {key: value}} with paths made absolute."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such profile; check --profile")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not valid TOML ({err})") from err
    result: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if section not in SCHEMA:
            raise InputError(f"{path}: unknown section [{section}]; expected one of "
                             f"{', '.join('[' + s + ']' for s in SCHEMA)}")
        if not isinstance(values, dict):
            raise InputError(f"{path}: {section} must be a table ([{section}])")
        result[section] = {}
        for key, value in values.items():
            if key not in SCHEMA[section]:
                raise InputError(f"{path}: unknown key {section}.{key}; [{section}] takes "
                                 f"{', '.join(SCHEMA[section])}")
            types, meaning = SCHEMA[section][key]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                expected = " or ".join(t.__name__ for t in types)
                raise InputError(f"{path}: {section}.{key} = {value!r}: expected {expected} ({meaning})")
            if (section, key) in PATH_KEYS and value != "random":
                value = str((path.parent / str(value)).resolve())
            result[section][key] = value
    model = result.get("model", {})
    if "source" in model and "factory" in model:
        raise InputError(f"{path}: model.source and model.factory both set; keep one")
    if not model.get("source") and not model.get("factory"):
        raise InputError(f"{path}: [model] needs source = \"FILE\" or factory = \"pkg.module:function\"")
    return result


def _given(value: Any) -> bool:
    return value not in (None, (), [])


def _merged(cls: type[T], options: Options, profile: Profile, **fixed: Any) -> T:
    """``cls`` from the command line (``options``, by option name), else the profile, else the field's default;
    ``fixed`` fields are given by the caller. A field with one profile key takes that key."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in fixed or "profile" not in f.metadata:
            continue
        keys: tuple[ProfileKey, ...] = f.metadata["profile"]
        option = f.metadata["option"] or f.name
        if _given(options.get(option)):
            value = options[option]
        elif len(keys) == 1 and keys[0].key in profile.get(keys[0].section, {}):
            value = profile[keys[0].section][keys[0].key]
        else:
            continue
        convert = f.metadata["convert"]
        values[f.name] = convert(value) if convert is not None else value
    return cls(**values, **fixed)


def export_settings(options: Options, profile: Profile | None = None) -> ExportSettings:
    """ExportSettings from the command-line options (``model``, ``model_factory``, ``inputs``, ``dims``, ``out``,
    ...) and the profile."""
    profile = profile or {}
    model = profile.get("model", {})
    path = options.get("model") or model.get("source")
    factory = options.get("model_factory") or (model.get("factory") if not options.get("model") else None)
    weights = options.get("weights") or (model.get("weights") if factory else None)
    trust = options.get("trust_pickle") if options.get("trust_pickle") is not None else model.get("trust_pickle")
    source = ModelSource(Path(path) if path else None, factory, Path(weights) if weights else None, bool(trust))
    inputs = list(options.get("inputs") or [parse_input_spec(s) for s in model.get("inputs", [])])
    dims = dict(options.get("dims") or [parse_dim_range(f"{k}={v}") for k, v in model.get("dims", {}).items()])
    if dims and not inputs:
        raise InputError("--dim given without --input: declare the inputs that use it")
    spec = ModelSpec(tuple(inputs), dims) if inputs else None
    if not _given(options.get("out")) and "out" not in profile.get("build", {}):
        raise InputError("no output directory: pass --out DIR (or set build.out in the profile)")
    return _merged(ExportSettings, options, profile, source=source, spec=spec)


def calibration_settings(options: Options, precision: str, profile: Profile | None = None) -> CalibrationSettings:
    """CalibrationSettings (with its gate) for ``precision`` from the command-line options and the profile."""
    profile = profile or {}
    return _merged(CalibrationSettings, options, profile, precision=precision,
                   gate=_merged(GateSettings, options, profile))


def build_settings(options: Options, buckets: tuple[int, ...], precision: str,
                   profile: Profile | None = None) -> BuildSettings:
    """BuildSettings for the export's ``buckets`` and ``precision`` from the command-line options and the profile."""
    return _merged(BuildSettings, options, profile or {}, buckets=buckets, precision=precision)


def bench_settings(options: Options) -> BenchSettings:
    """BenchSettings from ``trtc bench``'s command-line options (bench takes no profile keys)."""
    return _merged(BenchSettings, options, {})
