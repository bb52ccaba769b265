"""One ONNX Runtime session policy for every run of a build's graphs: a Q/DQ graph that ONNX Runtime's default
optimizations reject (a Concat of FP16-scaled Q/DQ inputs, fused into QLinearConcat) builds, loads through
``compiler.load`` and runs in ``trtc bench``; a precision file is written only when the serving configuration loads
it; ONNX Runtime's own warnings stay out of the output unless trtc logs at DEBUG."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import compiler
from calibration.load_check import LoadCheckBeside, check_serving_load
from compiler.cli import cli
from compiler.core import onnx_io
from compiler.core.errors import CalibrationError, InputError
from compiler.core.onnx_io import ort_session
from compiler.frontend.folding import fold_constants

RNG = np.random.default_rng(0)


class UpsampleConcat(nn.Module):
    """A segmentation decoder's shape: a strided branch upsampled by Resize, concatenated with a full-size conv
    branch, fused by a 1x1 conv (SegFormer's all-MLP decoder concatenates upsampled stages the same way)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.side = nn.Conv2d(16, 32, 3, padding=1)
        self.fuse = nn.Conv2d(64, 32, 1)
        self.head = nn.Conv2d(32, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.stem(x))
        up = F.interpolate(torch.relu(self.down(s)), scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.head(torch.relu(self.fuse(torch.cat([up, torch.relu(self.side(s))], dim=1))))


def upsample_concat() -> nn.Module:
    return UpsampleConcat().eval()


class _EncoderBlock(nn.Module):
    """torchvision's ViT encoder block: pre-norm ``nn.MultiheadAttention`` and a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TorchvisionStyleViT(nn.Module):
    """torchvision's ``vit_b_16`` in miniature (32x32 images, 8x8 patches, width 64, two blocks): a strided-conv patch
    embedding, a class token and learned positions, the encoder blocks, a LayerNorm and a linear head."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv_proj = nn.Conv2d(3, width, 8, 8)
        self.class_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.positions = nn.Parameter(torch.randn(1, 17, width) * 0.02)
        self.layers = nn.Sequential(_EncoderBlock(width, 4), _EncoderBlock(width, 4))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        return self.head(self.ln(self.layers(x))[:, 0])


def torchvision_style_vit() -> nn.Module:
    return TorchvisionStyleViT().eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("data")
    np.savez(d / "calib.npz", x=RNG.standard_normal((32, 3, 32, 32)).astype(np.float32))
    np.savez(d / "eval.npz", x=RNG.standard_normal((16, 3, 32, 32)).astype(np.float32))
    return d


def _build(data: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", f"{__name__}:upsample_concat", "--input",
                                      "x:Bx3x32x32", "--int8", "--buckets", "1,4", "--calib-data",
                                      str(data / "calib.npz"), *extra, "--engine", "none", "--out", str(out)])
    return result.exit_code, result.output


def test_int8_concat_of_fp16_scaled_qdq_builds_loads_and_benches(data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """At default settings the INT8 build of an upsample-concat decoder passes, and its model.int8.onnx, which ONNX
    Runtime's default session rejects (QLinearConcat takes no FP16 scale: so the case is real), loads through
    ``compiler.load`` on the onnxruntime backend with outputs within the gate's cosine of eager PyTorch, and
    ``trtc bench`` runs it: exit 0 and an onnxruntime/int8 row per bucket in bench.json. A file ONNX Runtime refuses
    (the policy's Q/DQ rule taken out) makes ``compiler.load`` raise a one-line InputError with ONNX Runtime's
    reason, not ONNX Runtime's own exception."""
    out = tmp_path / "m"
    code, output = _build(data, out, "--eval-data", str(data / "eval.npz"))
    assert code == 0, output
    path = out / "model.int8.onnx"
    with pytest.raises(Exception, match="QLinearConcat"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.load(data / "eval.npz")["x"][:4]
    engines = compiler.load(out, backend="onnxruntime", device="cpu", precision="int8")
    got = np.asarray(engines(x), np.float64).reshape(4, -1)
    with torch.no_grad():
        want = upsample_concat()(torch.from_numpy(x)).numpy().astype(np.float64).reshape(4, -1)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.99
    result = CliRunner().invoke(cli, ["bench", str(out), "--backends", "onnxruntime", "-n", "5", "--min-seconds",
                                      "0", "-q"])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "report" / "bench.json").read_text())["results"]
    assert sorted(r["bucket"] for r in rows if r["backend"] == "onnxruntime" and r["precision"] == "int8") == [1, 4]
    monkeypatch.delitem(onnx_io.SESSION_POLICY, "qdq")
    with pytest.raises(InputError, match=r"model.int8.onnx: ONNX Runtime cannot load it \(.*QLinearConcat") as err:
        compiler.load(out, backend="onnxruntime", device="cpu", precision="int8")
    assert "\n" not in str(err.value)


def test_a_precision_file_serving_cannot_load_is_never_written(data: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Q/DQ rule taken out of the session policy (as if ONNX Runtime's fusions ran on it) and no
    evaluation data (so no gate runs the graph), the load check before writing refuses the INT8 file: exit 2, one
    line naming the file and ONNX Runtime's own reason, and no model.int8.onnx or manifest entry."""
    monkeypatch.setenv("TRTC_IN_PROCESS", "1")  # the patched policy lives in this process, not in a worker
    monkeypatch.delitem(onnx_io.SESSION_POLICY, "qdq")
    out = tmp_path / "m"
    code, output = _build(data, out)
    assert code == 2, output
    last = output.strip().splitlines()[-1]
    assert "model.int8.onnx" in last and "QLinearConcat" in last and "Traceback" not in output
    assert not (out / "model.int8.onnx").exists()
    assert not (out / "manifest.json").exists() or "int8" not in json.loads((out / "manifest.json").read_text())["onnx"]


def test_the_load_check_skips_only_the_providers_that_ran_the_graph(data: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The load check before a precision file is kept loads it on each provider of the checks and serving unless
    that graph has just been loaded and run there: with the Q/DQ rule taken out of the policy (so a CPU session of
    model.int8.onnx fails), the check raises the one-line CalibrationError when nothing ran it or only CUDA did,
    and returns when the CPU provider is among those that ran it (nothing loads the file again)."""
    out = tmp_path / "m"
    code, output = _build(data, out, "--eval-data", str(data / "eval.npz"))
    assert code == 0, output
    feed = {"x": np.load(data / "eval.npz")["x"][:1]}
    monkeypatch.delitem(onnx_io.SESSION_POLICY, "qdq")
    for proven in (set(), {"CUDAExecutionProvider"}):
        with pytest.raises(CalibrationError, match=r"model.int8.onnx: ONNX Runtime's CPUExecutionProvider does not"):
            check_serving_load(out / "model.int8.onnx", feed, proven)
    check_serving_load(out / "model.int8.onnx", feed, {"CPUExecutionProvider"})


def test_the_load_check_beside_the_gate_vouches_only_for_the_candidate_it_ran(data: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the gate runs on another provider (the checking providers set to CUDA first, as on a GPU machine),
    LoadCheckBeside loads and runs its candidate on the CPU provider in a thread: for that candidate it reports
    the CPU as proven; for any other model it reports nothing; and with the Q/DQ rule taken out of the policy (a
    CPU session of the INT8 graph then fails) it raises the one-line CalibrationError for that candidate. Where
    the CPU is the gate's own provider it starts nothing and vouches for nothing."""
    import calibration.load_check as load_check

    code, output = _build(data, tmp_path / "m", "--eval-data", str(data / "eval.npz"))
    assert code == 0, output
    int8 = onnx.load(str(tmp_path / "m" / "model.int8.onnx"))
    other = onnx.load(str(tmp_path / "m" / "model.onnx"))
    feed = {"x": np.load(data / "eval.npz")["x"][:1]}
    with LoadCheckBeside(lambda: feed, "model.int8.onnx") as beside:
        beside.start(int8)
        assert beside.proven(int8) == set()  # the CPU is the gate's provider here: nothing ran beside it
    monkeypatch.setattr(load_check, "checking_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with LoadCheckBeside(lambda: feed, "model.int8.onnx") as beside:
        beside.start(int8)
        assert beside.proven(other) == set()
        assert beside.proven(int8) == {"CPUExecutionProvider"}
    monkeypatch.delitem(onnx_io.SESSION_POLICY, "qdq")
    with LoadCheckBeside(lambda: feed, "model.int8.onnx") as beside:
        beside.start(int8)
        assert beside.proven(other) == set()
        with pytest.raises(CalibrationError, match=r"model.int8.onnx: ONNX Runtime's CPUExecutionProvider does not"):
            beside.proven(int8)


_PLAIN_CPU_SESSION = """
import sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
session.run(None, {"images": np.ones((1, 3, 32, 32), np.float32)})
"""


def test_an_fp16_vit_whose_plain_cpu_session_crashes_builds_loads_and_benches(tmp_path: Path) -> None:
    """The FP16 build of a torchvision-style ViT passes at default settings, though ONNX Runtime 1.31 with every
    optimization on crashes the process (SIGSEGV in NchwcTransformer) creating a CPU session of its model.fp16.onnx
    (checked in a child process, so the case is real where it is that version); ``ort_session`` (the policy's FP16
    rule) loads it, ``compiler.load`` on the onnxruntime backend gives outputs within cosine 0.999 of eager PyTorch,
    and ``trtc bench`` runs it (exit 0, an onnxruntime/fp16 row per bucket)."""
    out = tmp_path / "vit"
    result = CliRunner().invoke(cli, ["build", "-q", "--model-factory", f"{__name__}:torchvision_style_vit", "--input",
                                      "images:Bx3x32x32", "--fp16", "--buckets", "1,4", "--calib-data", "random",
                                      "--calib-samples", "32", "--engine", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    path = out / "model.fp16.onnx"
    assert "fp16" in onnx_io.graph_holds(onnx.load(str(path), load_external_data=False))
    if ort.__version__.startswith("1.31."):
        plain = subprocess.run([sys.executable, "-c", _PLAIN_CPU_SESSION, str(path)], capture_output=True, timeout=120)
        assert plain.returncode == -signal.SIGSEGV, plain.stderr.decode()[-500:]
    x = RNG.standard_normal((4, 3, 32, 32)).astype(np.float32)
    engines = compiler.load(out, backend="onnxruntime", device="cpu", precision="fp16")
    got = np.asarray(engines(x), np.float64)
    with torch.no_grad():
        want = torchvision_style_vit()(torch.from_numpy(x)).numpy().astype(np.float64)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.999
    result = CliRunner().invoke(cli, ["bench", str(out), "--backends", "onnxruntime", "-n", "5", "--min-seconds",
                                      "0", "-q"])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "report" / "bench.json").read_text())["results"]
    assert sorted(r["bucket"] for r in rows if r["backend"] == "onnxruntime" and r["precision"] == "fp16") == [1, 4]


def _fp16_constant_mul() -> onnx.ModelProto:
    """y = x + a * b with a, b FP16 constants: ONNX Runtime's constant folding finds no FP16 Mul kernel on the CPU
    and warns about it at every session it makes (the warning trtc's FP16 remainders drew on every load)."""
    nodes = [helper.make_node("Mul", ["a", "b"], ["ab"]),
             helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("Add", ["x16", "ab"], ["y16"]),
             helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])],
                              [numpy_helper.from_array(np.full(4, 2, np.float16), "a"),
                               numpy_helper.from_array(np.full(4, 3, np.float16), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_onnx_runtime_warnings_show_only_when_trtc_logs_at_debug(capfd: pytest.CaptureFixture[str]) -> None:
    """A session on a graph that draws ONNX Runtime's constant-folding warning, and the export's constant folding of
    it (onnx-graphsurgeon makes sessions of its own), print nothing of ONNX Runtime's at trtc's default log level,
    and print the warning when trtc's logger is at DEBUG (what a verbose run sets), with the same outputs either
    way."""
    model, x = _fp16_constant_mul(), np.zeros((1, 4), np.float32)
    logger = logging.getLogger(onnx_io.__name__)
    level = logger.level
    try:
        logger.setLevel(logging.INFO)
        quiet = ort_session(model).run(None, {"x": x})[0]
        folded, _ = fold_constants(model)
        assert "onnxruntime" not in capfd.readouterr().err
        assert "Mul" not in [n.op_type for n in folded.graph.node]  # folded all the same
        logger.setLevel(logging.DEBUG)
        loud = ort_session(model).run(None, {"x": x})[0]
        assert "can't constant fold Mul" in capfd.readouterr().err
        fold_constants(model)
        assert "can't constant fold Mul" in capfd.readouterr().err
    finally:
        logger.setLevel(level)
        ort_session(model)  # leave ONNX Runtime's default logger at the quiet level for the tests after this one
    np.testing.assert_array_equal(quiet, loud)
    np.testing.assert_array_equal(quiet, np.full((1, 4), 6, np.float32))
