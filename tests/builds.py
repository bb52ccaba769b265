"""Build directories made in a second, as `trtc export` leaves them (a TorchScript-exported ONNX and its manifest),
for the tests of what reads them: the runtime, the batchers, bench, Triton export."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compiler.core.manifest import FileRecord, Manifest, write_manifest
from compiler.core.onnx_io import load_onnx, save_onnx
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.frontend.loading import LoadedModel, snapshot_into
from examples import models

__all__ = ["BUCKETS", "MODELS", "build_directory"]

BUCKETS = [1, 4, 8, 16]
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[str], dict[str, str]]] = {
    "mlp": (models.mlp, ["x:Bx64"], {}),
    "two_input": (models.two_input, ["image:Bx3x32x32", "features:Bx16"], {}),
    "transformer_encoder": (models.transformer_encoder, ["input_ids:BxS:int64", "attention_mask:BxS:int64"],
                            {"S": "1:16:32"}),
}


def build_directory(out: Path, name: str, buckets: list[int] = BUCKETS, **extra: Any) -> Path:
    """A build directory as `trtc export` leaves it (TorchScript-exported ONNX, manifest), in a second."""
    factory, inputs, dims = MODELS[name]
    spec = ModelSpec(tuple(parse_input_spec(i) for i in inputs),
                     dict(parse_dim_range(f"{k}={v}") for k, v in dims.items()))
    feed = spec.example_feed(2, values={**spec.opt_values(2), **{k: 8 for k in spec.dims}})
    dynamic = {i.name: {axis: d for axis, d in enumerate(i.dims) if isinstance(d, str)} for i in spec.inputs}
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "raw.onnx"
    model = factory()
    torch.onnx.export(model, tuple(torch.from_numpy(feed[n]) for n in spec.input_names), str(raw), dynamo=False,
                      input_names=spec.input_names, output_names=["out"], dynamic_axes={**dynamic, "out": {0: "B"}},
                      opset_version=17)
    save_onnx(load_onnx(raw), out / "model.onnx")
    raw.unlink()
    manifest = {"inputs": inputs, "dims": dims, "output_names": ["out"], "buckets": buckets,
                "source": {"path": f"examples.models:{name}", "format": "factory", "factory": f"examples.models:{name}",
                           "snapshot": snapshot_into(out, LoadedModel("factory", None, module=model)).to_json()},
                "onnx": {"fp32": FileRecord.for_onnx(out, out / "model.onnx").to_json()}, "precision": "fp32", **extra}
    write_manifest(out / "manifest.json", Manifest.from_json(manifest))
    return out
