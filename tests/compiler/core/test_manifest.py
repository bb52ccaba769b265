"""The typed manifest: every key of docs/manifest.md is a field, JSON goes in and out without losing a key (a newer
trtc's included), the update rules each command applies, and the checks of ``read_manifest``."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.manifest import (
    CalibrationRecord,
    EngineRecord,
    FileRecord,
    Manifest,
    ShapeRange,
    read_manifest,
    settings_to_dict,
    write_manifest,
)
from compiler.core.settings import BuildSettings
from tests.manifests import write_manifest_json
from tests.project import ROOT

ENV = {"tensorrt": "10.13.0.35", "gpu": "NVIDIA H200", "compute_capability": "9.0", "platform": "linux-x86_64"}
ONNX = {"file": "model.onnx", "files": ["model.onnx", "model.onnx.data"], "sha256": "a" * 64, "bytes": 2048}
ENGINE = {"bucket": 4, "file": "engines/b4.engine", "sha256": "b" * 64, "profile": 0, "bytes": 100,
          "shapes": {"x": {"min": [4, 64], "opt": [4, 64], "max": [4, 64]}}, "build_seconds": 1.5,
          "layers": {"file": "engines/b4.layers.json", "count": 1, "output_types": {"FP32": 1}},
          "onnx": "model.onnx", "onnx_sha256": "a" * 64}


def _every_key() -> dict[str, Any]:
    """A manifest JSON with every key docs/manifest.md names, and keys of a newer trtc at each level."""
    return {
        "schema_version": 1, "trtc_version": "0.1.0", "created": "2026-01-01T00:00:00+00:00",
        "tools": {"trtc": "0.1.0"},
        "source": {"path": "m.pt", "format": "torchscript", "sha256": "c" * 64,
                   "snapshot": {"file": "source/model.pt", "sha256": "d" * 64, "bytes": 10}, "newer": 1},
        "inputs": ["x:Bx64:float32"], "dims": {}, "output_names": ["y"], "buckets": [1, 4],
        "export": {"exporter": "dynamo", "opset": 18}, "passes": [{"name": "constant_folding"}],
        "verification": {"rtol": 1e-3}, "onnx": {"fp32": ONNX, "fp8": {**ONNX, "file": "model.fp8.onnx",
                                                                      "files": ["model.fp8.onnx"]}},
        "precision": "fp32", "calibration": {"method": "entropy"}, "fp16": {"casts": 2},
        "data": {"int8": {"calibration": None}}, "accuracy": {"int8": {"metric": "top1"}},
        "build": {**settings_to_dict(BuildSettings(buckets=(4,))), "from_a_newer_trtc": True},
        "engines": [{**ENGINE, "newer": [1]}], "engines_note": "not built: --engine none",
        "environment": {**ENV, "hardware_compat": "none", "version_compatible": False},
        "build_seconds": 3.25, "engines_built": "2026-01-02T00:00:00+00:00", "merged_from": ["b4"],
        "failed": "accuracy gate", "a_newer_key": {"kept": True},
    }


def test_every_key_of_the_docs_is_a_field() -> None:
    table = (ROOT / "docs" / "manifest.md").read_text().split("## manifest.json")[1].split("\n## ")[0]
    documented = {key for row in table.splitlines() if row.startswith("| `")
                  for key in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    fields = {f.name for f in dataclasses.fields(Manifest)} - {"extra", "build_extra"}
    assert documented - {"schema_version"} == fields


def test_json_round_trips_every_key_a_newer_trtc_too() -> None:
    data = _every_key()
    manifest = Manifest.from_json(data)
    assert manifest.to_json() == data
    assert manifest.extra == {"a_newer_key": {"kept": True}} and manifest.build_extra == {"from_a_newer_trtc": True}
    assert manifest.engines[0] == EngineRecord(4, "engines/b4.engine", "b" * 64, bytes=100,
                                               shapes={"x": ShapeRange((4, 64), (4, 64), (4, 64))},
                                               build_seconds=1.5, layers=ENGINE["layers"], onnx="model.onnx",
                                               onnx_sha256="a" * 64, extra={"newer": [1]})
    assert manifest.onnx["fp32"] == FileRecord("model.onnx", "a" * 64, ("model.onnx", "model.onnx.data"), 2048)
    assert sorted(manifest.onnx) == ["fp32", "fp8"]  # any precision name


def test_an_export_has_no_build_keys_and_writes_back_as_it_was(tmp_path: Path) -> None:
    data = {"schema_version": 1, "inputs": ["x:Bx64:float32"], "dims": {}, "output_names": ["y"], "buckets": [1],
            "onnx": {"fp32": ONNX}, "precision": "fp32"}
    manifest = Manifest.from_json(data)
    assert manifest.build is None and manifest.engines == () and manifest.to_json() == data
    assert manifest.tf32 is defaults.TF32 and manifest.rebuild_settings() == BuildSettings(buckets=(1,))


def test_the_update_rules() -> None:
    export = Manifest.from_json({"inputs": ["x:Bx64:float32"], "buckets": [1, 4], "onnx": {"fp32": ONNX},
                                 "accuracy": {"fp16": {"metric": "cosine"}}, "calibration": {"kept": 1}})
    int8 = FileRecord("model.int8.onnx", "e" * 64)
    calibrated = export.with_calibration(CalibrationRecord("int8", int8, {"metric": "top1"}, {"eval": None},
                                                           calibration={"method": "entropy"}))
    assert calibrated.precision == "int8" and calibrated.onnx == {"fp32": export.onnx["fp32"], "int8": int8}
    assert calibrated.accuracy_metrics == {"fp16": "cosine", "int8": "top1"}
    assert calibrated.calibration == {"kept": 1, "method": "entropy"} and calibrated.fp16 is None

    settings = BuildSettings(buckets=(4,), hardware_compat="same-compute-capability", tf32=False)
    none = calibrated.with_no_engines(settings, "not built: --engine none")
    assert none.engines == () and none.environment is None and none.to_json()["engines"] == []
    missing = calibrated.with_no_engines(settings, "not built: TensorRT is not installed here", ENV)
    assert missing.environment == {**ENV, "hardware_compat": "same-compute-capability", "version_compatible": False}
    engine = EngineRecord.from_json(ENGINE)
    built = missing.rebuilt(settings, ENV, [engine])
    assert built.engines == (engine,) and built.engines_note is None and built.engines_built is not None
    assert built.tf32 is False and built.hardware_compat == "same-compute-capability"
    assert built.engine_precision(engine) == "fp32"

    other = dataclasses.replace(engine, bucket=1, file="engines/b1.engine")
    merged = export.merged(built, [engine, other], ["b1"])
    assert [e.bucket for e in merged.engines] == [1, 4] and merged.build is not None
    assert merged.build.buckets == (1, 4) and merged.build.tf32 is False and merged.merged_from == ["b1"]
    assert merged.environment == built.environment


def test_read_manifest_checks_version_shape_settings_and_paths(tmp_path: Path) -> None:
    good = {"inputs": ["x:Bx64:float32"], "buckets": [1], "onnx": {"fp32": ONNX}}
    path = tmp_path / "manifest.json"
    write_manifest(path, Manifest.from_json(good))
    assert read_manifest(tmp_path).onnx["fp32"].names == ("model.onnx", "model.onnx.data")
    for data, message in [({**good, "schema_version": 2}, "schema_version 2, this trtc reads 1"),
                          ({**good, "buckets": [0]}, "'buckets' is malformed"),
                          ({**good, "build": {"precision": "fp64"}}, "precision 'fp64'"),
                          ({**good, "build": {"opt_level": "high"}}, "build settings do not parse"),
                          ({**good, "onnx": {"fp32": {**ONNX, "files": ["../x.onnx"]}}}, "not a relative path")]:
        write_manifest_json(path, data)
        with pytest.raises(InputError, match=re.escape(message)) as err:
            read_manifest(tmp_path)
        assert "\n" not in str(err.value) and str(path.parent) in str(err.value)
    path.write_text(json.dumps(good))  # no schema_version at all
    with pytest.raises(InputError, match="schema_version None"):
        read_manifest(tmp_path)
