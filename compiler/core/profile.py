"""``profiles/*.toml``: a model described once, so that ``trtc build --profile X`` is the CI command.

Relative paths in a profile are relative to the profile file's directory. Every key is
checked against ``SCHEMA``; errors name the file, the key and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib

from compiler.core.errors import InputError

__all__ = ["SCHEMA", "load_profile", "PATH_KEYS"]

# section -> key -> (expected type(s), what it means). This table is the documentation in README.
SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], str]]] = {
    "model": {
        "source": ((str,), "model file: TorchScript, ExportedProgram (.pt2), ONNX, or a pickle with trust_pickle"),
        "factory": ((str,), "pkg.module:function returning an nn.Module (instead of source)"),
        "weights": ((str,), "state dict for the factory, loaded with weights_only=True"),
        "trust_pickle": ((bool,), "allow loading a pickled nn.Module (runs arbitrary code)"),
        "inputs": ((list,), 'input specs, e.g. ["images:Bx3x224x224:float32"]'),
        "dims": ((dict,), 'ranges of non-batch dynamic dims, e.g. {S = "1:128:512"}'),
        "output_names": ((list,), "names for the ONNX outputs"),
    },
    "export": {
        "opset": ((int,), "ONNX opset (default: the exporter's)"),
        "rtol": ((float, int), "verification, relative part: |got - ref| <= atol * max(1, scale) + rtol * |ref| "
                 "(default 1e-3)"),
        "atol": ((float, int), "verification, absolute part (default 1e-4)"),
    },
    "calibration": {
        "data": ((str,), "calibration data: .npz/.npy file or folder, image folder, or 'random' (smoke tests)"),
        "loader": ((str,), "pkg.module:function yielding {input_name: array} batches"),
        "samples": ((int,), "maximum number of samples (default 512)"),
        "batch_size": ((int,), "samples per calibration batch (default 16)"),
        "method": ((str,), "percentile | max | entropy | mse (default percentile)"),
        "percentile": ((float, int), "percentile for the percentile method (default 99.99)"),
        "labels": ((str,), "labels for the accuracy gate: .npy file, or the key in the .npz calibration data"),
        "eval_data": ((str,), "held-out data for the accuracy gate (default: the calibration data)"),
        "max_accuracy_drop": ((float, int), "top-1 points (with labels; default 0.5) the gate allows"),
        "min_cosine": ((float, int), "cosine floor against FP32 without labels (default 0.99)"),
        "max_fallback": ((int,), "layers the gate may keep in FP32 (default 8)"),
        "keep_fp32": ((list,), "node names or op types kept in FP32"),
        "fp32_rest": ((bool,), "int8: run what is not INT8 in FP32 instead of FP16 (default false)"),
        "image": ((dict,), "image preprocessing: size, crop, mean, std, layout (NCHW/NHWC), input"),
    },
    "build": {
        "out": ((str,), "output directory"),
        "buckets": ((list,), "batch buckets, e.g. [1, 4, 8, 16]"),
        "precision": ((str,), "fp32 | fp16 | int8"),
        "multi_profile": ((bool,), "one engine with one optimization profile per bucket"),
        "workspace_mib": ((int,), "builder workspace limit in MiB"),
        "opt_level": ((int,), "builder optimization level 0-5 (default 3)"),
        "hardware_compat": ((bool, str), "none | same-compute-capability | ampere-plus (true: ampere-plus)"),
        "tf32": ((bool,), "FP32 layers may use TF32 tensor cores (default true)"),
        "version_compatible": ((bool,), "build engines that later TensorRT versions can run"),
        "timing_cache": ((str,), "timing cache shared across models"),
        "engine": ((str,), "tensorrt | none"),
    },
}
PATH_KEYS = {("model", "source"), ("model", "weights"), ("calibration", "data"), ("calibration", "labels"),
             ("calibration", "eval_data"), ("build", "out"), ("build", "timing_cache")}


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
