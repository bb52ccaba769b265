"""How many copies of the weights model writing and the INT8 candidate build hold (the calibration memory target).

The memory tests run in a fresh process on a synthetic MLP with 256 MiB of FP32 weights and read its peak RSS
(``VmHWM``, Linux), so that nothing else the test session holds counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from calibration.fp16 import int8_fp16_model_from
from calibration.fp16_policy import Fp16Policy
from calibration.qdq import QdqPolicy, qdq_model_from, tensors_to_calibrate
from compiler.core.onnx_io import load_onnx, load_onnx_by_reference, ort_session, save_onnx, tensor_array

MIB = 1 << 20
linux_only = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads peak RSS from /proc (Linux)")


def mlp(width: int, layers: int, seed: int = 0) -> onnx.ModelProto:
    """``layers`` MatMul + Relu of ``width`` x ``width`` FP32 weights (raw data); the last MatMul is the head."""
    rng = np.random.default_rng(seed)
    nodes, inits, tensor = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [tensor, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        tensor = f"h{i}"
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [tensor], [f"r{i}"], name=f"relu{i}"))
            tensor = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", width])],
                              [helper.make_tensor_value_info(tensor, TensorProto.FLOAT, ["B", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 10
    return model


def candidate(model: onnx.ModelProto) -> onnx.ModelProto:
    """The INT8 candidate as ``trtc calibrate --int8`` builds it: Q/DQ, then the FP16 remainder."""
    amax = dict.fromkeys(tensors_to_calibrate(model), 4.0)
    qdq, _ = qdq_model_from(model, amax, QdqPolicy())
    return int8_fp16_model_from(qdq, Fp16Policy())[0]


_PEAK = """
import sys
from pathlib import Path
from compiler.core.onnx_io import load_onnx, load_onnx_by_reference, save_onnx
from tests.calibration.test_weight_copies import candidate, mlp

def peak():  # VmHWM, not ru_maxrss: that one starts from the parent's peak (Linux keeps it across exec)
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024

what, folder = sys.argv[1], Path(sys.argv[2])
if what == "write":
    model = mlp(2048, 16)
    before = peak()
    for i in range(3):
        save_onnx(model, folder / f"copy{i}.onnx")
    print(before, peak())
elif what == "model":
    save_onnx(mlp(2048, 16), folder / "model.onnx")
elif what == "fold":
    from compiler.frontend.folding import fold_constants
    model = load_onnx(folder / "model.onnx")
    loaded = peak()
    folded = fold_constants(model)[0]
    print(loaded, peak())
else:  # in a process of its own, so that the peak before the build is the loaded model's
    start = peak()
    model = (load_onnx if what == "loaded" else load_onnx_by_reference)(folder / "model.onnx")
    loaded = peak()
    built = candidate(model)
    print(loaded if what == "loaded" else start, peak())
"""


def _peak_growth(what: str, folder: Path) -> int:
    """Bytes the peak RSS of a fresh process grows by while it does ``what`` (see ``_PEAK``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _PEAK, what, str(folder)], env=env, capture_output=True,
                          text=True, check=True)
    before, after = (int(v) for v in done.stdout.split()[-2:]) if what != "model" else (0, 0)
    return after - before


@pytest.fixture(scope="module")
def big_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``model.onnx``: the memory tests' 256 MiB MLP."""
    folder = tmp_path_factory.mktemp("big_mlp")
    _peak_growth("model", folder)
    return folder


WEIGHTS = 16 * 2048 * 2048 * 4  # bytes of FP32 weights in the memory tests' model


@pytest.mark.slow
@linux_only
def test_saving_a_model_three_times_holds_no_second_copy_of_its_weights(tmp_path: Path) -> None:
    # onnx.save_model(save_as_external_data=True) moves the weights out of the proto and reloading them grew
    # protobuf's arena by their size on each save: 3 x 256 MiB here
    growth = _peak_growth("write", tmp_path)
    assert growth < WEIGHTS // 4, f"peak RSS grew by {growth / MIB:.0f} MiB saving 256 MiB of weights 3 times"


@linux_only
def test_the_int8_candidate_build_holds_no_copy_of_the_fp32_weights(big_mlp: Path) -> None:
    # Q/DQ used to start from a copy of the whole model: 256 MiB more, then the FP16 pass on top
    growth = _peak_growth("loaded", big_mlp)  # from the loaded model's peak
    # new: the INT8 weights (64 MiB) in the Q/DQ model and again in the candidate, the FP32 head (16 MiB) and its
    # FP16 version, one FP32 weight at a time while quantizing (412 MiB before)
    assert growth < WEIGHTS * 3 // 4, f"peak RSS grew by {growth / MIB:.0f} MiB building the candidate"


@linux_only
def test_a_candidate_built_by_reference_holds_only_its_new_weights(big_mlp: Path) -> None:
    # loading by reference costs nothing: the whole load and build stays under the FP32 weights' size
    growth = _peak_growth("reference", big_mlp)  # from the process's start
    assert growth < WEIGHTS * 3 // 4, f"peak RSS grew by {growth / MIB:.0f} MiB loading and building the candidate"


@linux_only
def test_constant_folding_copies_the_weights_once(big_mlp: Path) -> None:
    # onnx-graphsurgeon's export copied each weight twice (into the graph, then the graph into the model)
    growth = _peak_growth("fold", big_mlp)  # from the loaded model's peak
    assert growth < WEIGHTS * 3 // 2, f"peak RSS grew by {growth / MIB:.0f} MiB folding constants"


def test_by_reference_and_loaded_builds_write_the_same_model(tmp_path: Path) -> None:
    model = mlp(64, 4)
    model.graph.initializer.append(numpy_helper.from_array(np.arange(8, dtype=np.float32), "unused_small"))
    save_onnx(model, tmp_path / "fp32.onnx")
    loaded, referenced = load_onnx(tmp_path / "fp32.onnx"), load_onnx_by_reference(tmp_path / "fp32.onnx")
    assert all(t.data_location == TensorProto.EXTERNAL for t in referenced.graph.initializer if t.name[0] == "w")
    for t, r in zip(loaded.graph.initializer, referenced.graph.initializer):
        np.testing.assert_array_equal(tensor_array(r), numpy_helper.to_array(t))
    save_onnx(candidate(loaded), tmp_path / "a" / "int8.onnx")
    save_onnx(candidate(referenced), tmp_path / "b" / "int8.onnx")
    a, b = load_onnx(tmp_path / "a" / "int8.onnx"), load_onnx(tmp_path / "b" / "int8.onnx")
    assert a.SerializeToString() == b.SerializeToString()
    # the FP32 model written from references (copied from their file) is the model, and runs the same
    save_onnx(referenced, tmp_path / "c" / "fp32.onnx")
    assert load_onnx(tmp_path / "c" / "fp32.onnx").SerializeToString() == loaded.SerializeToString()
    x = {"x": np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)}
    np.testing.assert_array_equal(ort_session(tmp_path / "c" / "fp32.onnx").run(None, x)[0],
                                  ort_session(loaded).run(None, x)[0])


def test_save_onnx_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = mlp(64, 2)
    model.ir_version = 11  # written as 10 (ONNX Runtime's limit), but the caller's proto keeps its own
    before = model.SerializeToString()
    files = save_onnx(model, tmp_path / "m.onnx")
    assert model.SerializeToString() == before
    assert [f.name for f in files] == ["m.onnx", "m.onnx.data"]
    written = load_onnx(tmp_path / "m.onnx")
    assert written.ir_version == 10
    for t, w in zip(model.graph.initializer, written.graph.initializer):
        np.testing.assert_array_equal(numpy_helper.to_array(w), numpy_helper.to_array(t))


def test_a_model_loaded_by_reference_can_be_saved_over_its_own_files(tmp_path: Path) -> None:
    model = mlp(64, 3)
    save_onnx(model, tmp_path / "m.onnx")
    first = load_onnx(tmp_path / "m.onnx").SerializeToString()
    save_onnx(load_onnx_by_reference(tmp_path / "m.onnx"), tmp_path / "m.onnx")
    assert load_onnx(tmp_path / "m.onnx").SerializeToString() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]  # no partial file left


def test_weights_that_were_never_loaded_are_refused_by_name(tmp_path: Path) -> None:
    save_onnx(mlp(64, 2), tmp_path / "m.onnx")
    graph_only = load_onnx(tmp_path / "m.onnx", load_weights=False)
    with pytest.raises(ValueError, match="'w0' is external data that was not loaded"):
        tensor_array(graph_only.graph.initializer[0])
    with pytest.raises(ValueError, match="'w0' is external data that was not loaded"):
        qdq_model_from(graph_only, dict.fromkeys(tensors_to_calibrate(graph_only), 1.0))


def test_the_emulation_computes_int8_weights_as_onnx_runtime_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # ONNX Runtime's constant folding of the weights' DequantizeLinear -> Cast(FP16) -> Cast(FP32) holds every
    # weight three times while the session is built; the emulation computes them itself, with the same values
    from calibration import fp16_rounding

    model = candidate(mlp(64, 4, seed=5))
    emulated = fp16_rounding.fp16_rounding_emulation(model)
    constants = {t.name for t in emulated.graph.initializer}
    assert not [n.name for n in emulated.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants]
    assert not any(t.data_type == TensorProto.INT8 and len(t.dims) == 2 for t in emulated.graph.initializer)
    monkeypatch.setattr(fp16_rounding, "_dequantized_weights", lambda graph, types: {})
    by_onnx_runtime = fp16_rounding.fp16_rounding_emulation(model)
    weights = {t.name for t in by_onnx_runtime.graph.initializer}
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] in weights for n in by_onnx_runtime.graph.node) == 3
    x = {"x": np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32) * 3}
    np.testing.assert_array_equal(ort_session(emulated).run(None, x)[0],
                                  ort_session(by_onnx_runtime).run(None, x)[0])


def test_a_temporary_onnx_file_holds_no_reference_to_its_model() -> None:
    """The gate drops its FP16 emulation inside the block, so ONNX Runtime's load is the only copy left."""
    import sys

    from compiler.core.onnx_io import TemporaryOnnxFile

    model = mlp(32, 2)  # 4 KiB weights: written to the data file
    references = sys.getrefcount(model)
    with TemporaryOnnxFile(model) as path:
        assert sys.getrefcount(model) == references and path.is_file() and (path.parent / "model.onnx.data").is_file()
        session = ort_session(path)
    assert not path.parent.exists()
    x = np.ones((1, 32), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], ort_session(model).run(None, {"x": x})[0])
