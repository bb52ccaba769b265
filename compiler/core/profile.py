"""``profiles/*.toml``: a model described once, so that ``trtc build --profile X`` is the CI command.

Relative paths in a profile are relative to the profile file's directory. Every key is
checked against ``SCHEMA``; errors name the file, the key and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib

from compiler.core import defaults
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
                 f"(default {defaults.RTOL:g})"),
        "atol": ((float, int), f"verification, absolute part (default {defaults.ATOL:g})"),
    },
    "calibration": {
        "data": ((str,), "calibration data: .npz/.npy file or folder, image folder, or 'random' (smoke tests)"),
        "loader": ((str,), "pkg.module:function yielding {input_name: array} batches"),
        "samples": ((int,), f"maximum number of samples (default {defaults.CALIB_SAMPLES})"),
        "batch_size": ((int,), f"samples per calibration batch (default {defaults.CALIB_BATCH})"),
        "method": ((str,), f"percentile | max | entropy | mse (default {defaults.CALIB_METHOD})"),
        "percentile": ((float, int), f"percentile for the percentile method (default {defaults.PERCENTILE:g})"),
        "labels": ((str,), "labels for the accuracy gate: .npy file, or the key in the .npz calibration data"),
        "eval_data": ((str,), "held-out data for the accuracy gate (default: the calibration data)"),
        "max_accuracy_drop": ((float, int), f"top-1 points the gate allows, with labels (default "
                              f"{defaults.MAX_ACCURACY_DROP:g})"),
        "min_cosine": ((float, int), "cosine floor against FP32 without labels (default "
                       f"{defaults.GATE_MIN_COSINE:g})"),
        "max_fallback": ((int,), f"layers the gate may keep in FP32 (default {defaults.MAX_FALLBACK})"),
        "keep_fp32": ((list,), "node names or op types kept in FP32"),
        "fp32_rest": ((bool,), "int8: run what is not INT8 in FP32 instead of FP16 (default "
                           f"{str(defaults.FP32_REST).lower()})"),
        "image": ((dict,), "image preprocessing: size, crop, mean, std, layout (NCHW/NHWC), input"),
    },
    "build": {
        "out": ((str,), "output directory"),
        "buckets": ((list,), f"batch buckets (default {list(defaults.BUCKETS)})"),
        "precision": ((str,), f"fp32 | fp16 | int8 (default {defaults.PRECISION})"),
        "multi_profile": ((bool,), "one engine with one optimization profile per bucket"),
        "workspace_mib": ((int,), "builder workspace limit in MiB"),
        "opt_level": ((int,), f"builder optimization level 0-5 (default {defaults.OPT_LEVEL})"),
        "hardware_compat": ((bool, str), "none | same-compute-capability | ampere-plus (true: ampere-plus; "
                                          f"default {defaults.HARDWARE_COMPAT})"),
        "tf32": ((bool,), f"FP32 layers may use TF32 tensor cores (default {str(defaults.TF32).lower()})"),
        "version_compatible": ((bool,), "build engines that later TensorRT versions can run"),
        "timing_cache": ((str,), "timing cache shared across models"),
        "engine": ((str,), f"tensorrt | none (default {defaults.ENGINE})"),
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
