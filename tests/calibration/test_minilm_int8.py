"""INT8 with the FP16 rest on a MiniLM-like BERT (examples.minilm: all-MiniLM-L6-v2's config, random weights with
imitated outlier channels), exported from PyTorch and calibrated at the defaults on two different data sets.

Scored here, not by the gate: each written model runs in its own ONNX Runtime session (Q/DQ executed exactly)
against the FP32 export on held-out sentences, cosine per real token, over all channels and over the
ordinary (non-outlier) channels alone, which the outlier channels would otherwise dominate.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.onnx_io import load_onnx, ort_session
from compiler.core.settings import ExportSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.pipeline.export import export_directory
from examples.minilm import OUTLIER_CHANNELS, minilm_like, token_batches  # transformers: in the dev extra

pytestmark = pytest.mark.slow  # ~3 min on 2 cores: a BERT export and two calibrations

SPEC = ModelSpec((parse_input_spec("input_ids:BxS:int64"), parse_input_spec("attention_mask:BxS:int64")),
                 dict([parse_dim_range("S=1:48:128")]))
MIN_COSINE = 0.99


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("minilm")
    torch.save(minilm_like().state_dict(), tmp / "weights.pt")
    for name, seed in (("calib_a", 1), ("calib_b", 3), ("eval", 2)):
        (tmp / name).mkdir()
        for i, batch in enumerate(token_batches(seed, 6, max_len=48 if name != "calib_b" else 96)):
            np.savez(tmp / name / f"{i:03d}.npz", **batch)
    export_directory(ExportSettings(ModelSource(factory="examples.minilm:minilm_like", weights=tmp / "weights.pt"),
                                    tmp / "fp32", spec=SPEC, buckets=(1, 8)))
    return tmp


def _cosines(fp32: Path, candidate: Path, eval_dir: Path, channels: np.ndarray | None) -> np.ndarray:
    reference, session = ort_session(fp32), ort_session(candidate)
    out = []
    for path in sorted(eval_dir.glob("*.npz")):
        feed = dict(np.load(path))
        real = feed["attention_mask"].astype(bool)
        want = reference.run(None, feed)[0][real].astype(np.float64)
        got = session.run(None, feed)[0][real].astype(np.float64)
        if channels is not None:
            want, got = want[:, channels], got[:, channels]
        out.append((want * got).sum(1) / (np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1)))
    return np.concatenate(out)


@pytest.mark.parametrize("calib", ["calib_a", "calib_b"])  # b: twice as long sentences, rarer outliers
def test_int8_fp16_rest_passes_at_defaults_on_two_data_sets(exported: Path, calib: str, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    shutil.copytree(exported / "fp32", directory)
    result = CliRunner().invoke(cli, ["calibrate", str(directory), "-q", "--int8", "--calib-data",
                                      str(exported / calib), "--eval-data", str(exported / "eval")])
    assert result.exit_code == 0, result.output
    report = json.loads((directory / "report" / "accuracy.json").read_text())["int8"]
    assert report["kept_in_fp32"] == {}  # passes without the fallback
    counts = report["node_precisions"]["counts"]
    assert counts["int8"] == 36 and counts["fp16"] > 100  # 6 layers x 6 linears; LayerNorm, GELU, adds in FP16

    model = load_onnx(directory / "model.int8.onnx")
    fp16_layernorms = [n for n in model.graph.node if n.op_type == "LayerNormalization"
                       and n.name in report["node_precisions"]["fp16"]]
    assert fp16_layernorms
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT

    fp32 = directory / "model.onnx"
    ordinary = np.setdiff1d(np.arange(384), OUTLIER_CHANNELS)
    assert _cosines(fp32, directory / "model.int8.onnx", exported / "eval", None).mean() >= MIN_COSINE
    assert _cosines(fp32, directory / "model.int8.onnx", exported / "eval", ordinary).mean() >= MIN_COSINE
