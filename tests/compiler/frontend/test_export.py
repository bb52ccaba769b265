"""`trtc export` end to end on the bundled examples: ONNX Runtime must match eager PyTorch."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.files import sha256_files
from compiler.core.onnx_io import ort_session
from examples import models

EXAMPLES = {
    "resnet_cnn": (models.resnet_cnn, ["--input", "images:Bx3x32x32"]),
    "mlp": (models.mlp, ["--input", "x:Bx64"]),
    "transformer_encoder": (models.transformer_encoder, ["--input", "input_ids:BxS:int64", "--input",
                                                         "attention_mask:BxS:int64", "--dim", "S=1:16:64"]),
    "two_input": (models.two_input, ["--input", "image:Bx3x32x32", "--input", "features:Bx16"]),
}


def export(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["export", "-q", *args])
    return result.exit_code, result.output


def eager_vs_onnx(module: torch.nn.Module, onnx_path: Path, feed: dict[str, np.ndarray]) -> float:
    with torch.no_grad():
        want = module(*[torch.from_numpy(v) for v in feed.values()]).numpy()
    got = ort_session(onnx_path).run(None, feed)[0]
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_export_each_example_matches_eager(name: str, tmp_path: Path) -> None:
    factory, args = EXAMPLES[name]
    out = tmp_path / name
    code, output = export(["--model-factory", f"examples.models:{name}", *args, "--buckets", "1,4", "--out",
                           str(out)])
    assert code == 0, output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["export"]["exporter"] == "dynamo"
    assert [p["name"] for p in manifest["passes"]][:4] == ["shape_inference", "constant_folding",
                                                           "batchnorm_folding", "cleanup"]
    assert {c["batch"] for c in manifest["verification"]["passes"]} == {1, 4}
    assert all(c["max_rel"] < 1e-4 for c in manifest["verification"]["passes"])
    # weights live beside the graph and the manifest's digest covers both files
    entry = manifest["onnx"]["fp32"]
    assert entry["files"] == ["model.onnx", "model.onnx.data"]
    assert entry["sha256"] == sha256_files([out / f for f in entry["files"]])
    model = onnx.load(str(out / "model.onnx"))
    assert Counter(n.op_type for n in model.graph.node)["BatchNormalization"] == 0
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "B"
    # an independent check at a batch the exporter never saw
    from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec

    specs = [parse_input_spec(a) for a in args[1::2] if ":" in a and "=" not in a]
    dims = dict(parse_dim_range(a) for a in args if "=" in a)
    feed = ModelSpec(tuple(specs), dims).example_feed(batch=3, seed=7)
    assert eager_vs_onnx(factory(), out / "model.onnx", feed) < 1e-4


@pytest.mark.slow
def test_export_torchscript_and_exported_program_and_onnx_files(tmp_path: Path) -> None:
    model = models.resnet_digits()
    x = torch.randn(2, 1, 8, 8)
    torch.jit.save(torch.jit.trace(model, x), tmp_path / "cnn.ts")
    code, output = export([str(tmp_path / "cnn.ts"), "--input", "images:Bx1x8x8", "--out", str(tmp_path / "ts")])
    assert code == 0, output
    manifest = json.loads((tmp_path / "ts" / "manifest.json").read_text())
    assert manifest["export"]["exporter"] == "torchscript" and manifest["source"]["format"] == "torchscript"
    # no GPU here: both sides of the checks ran on the CPU, and the manifest says so
    assert manifest["verification"]["devices"] == {"onnxruntime": "CPUExecutionProvider", "torch": "cpu", "tf32": False}
    feed = {"images": np.random.default_rng(3).normal(size=(5, 1, 8, 8)).astype(np.float32)}
    assert eager_vs_onnx(model, tmp_path / "ts" / "model.onnx", feed) < 1e-4

    mlp = models.mlp()
    program = torch.export.export(mlp, (torch.randn(2, 64),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    torch.export.save(program, tmp_path / "mlp.pt2")
    code, output = export([str(tmp_path / "mlp.pt2"), "--out", str(tmp_path / "ep")])  # shapes from the program
    assert code == 0, output
    manifest = json.loads((tmp_path / "ep" / "manifest.json").read_text())
    assert manifest["inputs"] == ["x:Bx64:float32"]
    feed = {"x": np.random.default_rng(4).normal(size=(7, 64)).astype(np.float32)}
    assert eager_vs_onnx(mlp, tmp_path / "ep" / "model.onnx", feed) < 1e-4
    # the torch serving backend (bench's torch rows) runs the program's module, which has no train/eval switch
    from compiler import load

    with load(tmp_path / "ep", backend="torch", device="cpu") as engines:
        np.testing.assert_allclose(engines(feed["x"]), mlp(torch.from_numpy(feed["x"])).detach().numpy(),
                                   rtol=1e-5, atol=1e-5)

    # the exported ONNX goes through again as an ONNX input: no export, same passes
    code, output = export([str(tmp_path / "ep" / "model.onnx"), "--input", "x:Bx64", "--out", str(tmp_path / "ox")])
    assert code == 0, output
    manifest = json.loads((tmp_path / "ox" / "manifest.json").read_text())
    assert manifest["export"]["exporter"] == "onnx-input"
    assert manifest["verification"]["reference"] == "onnxruntime[original ONNX]"
    assert manifest["verification"]["devices"]["torch"] is None


@pytest.mark.slow
def test_failed_export_keeps_the_previous_contents(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--model-factory", "examples.models:mlp", "--input", "x:Bx64", "--out", str(out)]
    assert export(args)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, output = export(["--model-factory", "examples.models:mlp", "--input", "x:Bx65", "--out", str(out)])
    assert code == 2 and "fix the --input shapes" in output
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before
    assert not [p for p in out.iterdir() if p.name.startswith(".staging")]


def test_unsupported_operator_is_named(tmp_path: Path) -> None:
    @torch.library.custom_op("trtc_test::mystery", mutates_args=())
    def mystery(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @mystery.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    class Odd(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return mystery(x) + 1

    from compiler.core.errors import ExportError
    from compiler.core.specs import ModelSpec, parse_input_spec
    from compiler.frontend.export import onnx_from_torch
    from compiler.frontend.loading import LoadedModel

    with pytest.raises(ExportError, match=r"trtc_test::mystery"):
        onnx_from_torch(LoadedModel("factory", None, module=Odd()), ModelSpec((parse_input_spec("x:Bx4"),)), 8,
                        workdir=tmp_path)


TOKEN_TYPES = ["--model-factory", "tests.zoo_models:token_types", "--input", "input_ids:BxS:int64", "--input",
               "attention_mask:BxS:int64", "--dim", "S=1:8:16", "--buckets", "1,4"]


def test_integer_inputs_get_values_a_two_row_embedding_accepts(tmp_path: Path) -> None:
    """Random token types in [0, 100) would make a BERT's 2-row type embedding reject the export: the declared
    range [0, 2) is what example inputs take."""
    code, output = export([*TOKEN_TYPES, "--input", "token_type_ids:BxS:int64", "--out", str(tmp_path / "zeros")])
    assert code == 0, output
    code, output = export([*TOKEN_TYPES, "--input", "token_type_ids:BxS:int64[0,2)", "--out", str(tmp_path / "r")])
    assert code == 0, output
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert "token_type_ids:BxS:int64[0,2)" in manifest["inputs"]


def test_values_the_model_rejects_are_named_with_their_range(tmp_path: Path) -> None:
    code, output = export([*TOKEN_TYPES, "--input", "token_type_ids:BxS:int64[0,5)", "--out", str(tmp_path / "o")])
    assert code == 2, output
    assert "input 'token_type_ids' (values in [0, 5))" in output and "[LOW,HIGH)" in output, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output
    assert not (tmp_path / "o" / "model.onnx").exists()


@pytest.mark.slow
def test_build_exports_and_verifies_on_the_calibration_data(tmp_path: Path) -> None:
    """Ids that start at 1: the default zeros are rejected, the user's calibration data is used instead."""
    ids = np.random.default_rng(0).integers(1, 1000, (40, 8)).astype(np.int64)
    np.savez(tmp_path / "calib.npz", input_ids=ids)
    args = ["--model-factory", "tests.zoo_models:one_based_ids", "--input", "input_ids:BxS:int64", "--dim", "S=1:8:16",
            "--buckets", "1,4"]
    code, output = export([*args, "--out", str(tmp_path / "zeros")])
    assert code == 2 and "integer inputs' value ranges (input_ids: zeros)" in output, output
    result = CliRunner().invoke(cli, ["build", "-q", *args, "--fp16", "--calib-data", str(tmp_path / "calib.npz"),
                                      "--engine", "none", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    verification = json.loads((tmp_path / "b" / "manifest.json").read_text())["verification"]
    assert verification["inputs"] == f"the first 4 sample(s) of {tmp_path / 'calib.npz'}"
    assert [c["batch"] for c in verification["export"]] == [1, 4]


def test_export_traces_and_verifies_on_example_data(tmp_path: Path) -> None:
    """Ids that start at 1, which the generated zeros break: with --example-data (one batch of samples) trtc export
    traces on them and runs the export and pass checks on them at batches 1 and 4 (the 3 samples repeated)."""
    ids = np.random.default_rng(0).integers(1, 1000, (3, 8)).astype(np.int64)
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    args = ["--model-factory", "tests.zoo_models:one_based_ids", "--input", "input_ids:BxS:int64", "--dim", "S=1:8:16",
            "--buckets", "1,4", "--example-data", str(tmp_path / "ids.npz"), "--out", str(tmp_path / "e")]
    code, output = export(args)
    assert code == 0, output
    verification = json.loads((tmp_path / "e" / "manifest.json").read_text())["verification"]
    assert verification["inputs"] == f"--example-data 3 sample(s) of {tmp_path / 'ids.npz'}"
    assert [c["batch"] for c in verification["export"]] == [1, 4]


def test_a_forward_with_varargs_goes_through_the_dynamo_exporter(tmp_path: Path) -> None:
    code, output = export(["--model-factory", "tests.zoo_models:varargs", "--input", "x:Bx8", "--input", "y:Bx6",
                           "--input", "z:Bx4", "--buckets", "1,4", "--out", str(tmp_path / "v")])
    assert code == 0, output
    manifest = json.loads((tmp_path / "v" / "manifest.json").read_text())
    assert manifest["export"]["exporter"] == "dynamo", manifest["export"]["fallback_reason"]


HEADS = '''
import torch


class Detector(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.boxes, self.scores = torch.nn.Linear(8, 4), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x)
        return {"boxes": self.boxes(h), "scores": self.scores(h).softmax(-1)}


class Pair(Detector):
    def forward(self, x):
        out = super().forward(x)
        return out["boxes"], out["scores"]


class Plain(Detector):
    def forward(self, x):
        return self.boxes(self.body(x))
'''


def test_outputs_are_named_by_what_the_model_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves: without --output-names, the ONNX outputs of a model returning a dict carry its keys, of a tuple
    output_0, output_1, of one tensor output_0 (not the exporter's node names), ONNX Runtime's outputs under those
    names equal eager PyTorch's, the torch serving backend of the same module names them alike, and a profile's
    model.output_names still wins."""
    from compiler.serve.load import engines_from_module

    (tmp_path / "named_heads.py").write_text(HEADS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import named_heads

    profile = tmp_path / "named.toml"
    profile.write_text('[model]\nfactory = "named_heads:Pair"\noutput_names = ["b", "s"]\n')
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for cls, names, extra in (("Detector", ["boxes", "scores"], []), ("Pair", ["output_0", "output_1"], []),
                              ("Plain", ["output_0"], []), ("Pair", ["b", "s"], ["--profile", str(profile)])):
        out = tmp_path / f"{cls}-{len(extra)}"
        code, output = export(["--model-factory", f"named_heads:{cls}", "--input", "x:Bx8", "--buckets", "1,4",
                               *extra, "--out", str(out)])
        assert code == 0, output
        assert json.loads((out / "manifest.json").read_text())["output_names"] == names
        session = ort_session(out / "model.onnx")
        assert [o.name for o in session.get_outputs()] == names
        module = getattr(named_heads, cls)().eval()
        with torch.no_grad():
            want = module(torch.from_numpy(x))
        flat = list(want.values()) if isinstance(want, dict) else list(want) if isinstance(want, tuple) else [want]
        for got, ref in zip(session.run(None, {"x": x}), flat):
            np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-6)
        if not extra:
            engines = engines_from_module(module, ["x:Bx8"], buckets=(1, 4), device="cpu", contexts=1)
            assert engines.output_names == names
