from __future__ import annotations

import numpy as np
import pytest

from compiler.core.errors import InputError
from compiler.core.specs import DimRange, InputSpec, ModelSpec, parse_buckets, parse_dim_range, parse_input_spec


def test_input_spec_parses_dynamic_and_fixed_dims() -> None:
    spec = parse_input_spec("images:Bx3x224x224:float32")
    assert spec == InputSpec("images", ("B", 3, 224, 224), "float32")
    assert parse_input_spec("ids:BxS:int64").dims == ("B", "S")
    assert parse_input_spec("x:Bx64").dtype == "float32"
    assert spec.shape({"B": 4}) == (4, 3, 224, 224)


@pytest.mark.parametrize("text", ["images", ":Bx3", "images:Bx0x3", "images:Bx3:float99", "a:b:c:d", "images:Bx-3",
                                  "images:Bx3:float64"])
def test_bad_input_specs_are_rejected_with_the_fix(text: str) -> None:
    with pytest.raises(InputError, match="input spec"):
        parse_input_spec(text)


NAMES_AND_RANK_0 = [("0:3x4:float32", "0", (3, 4)), ("input:0:Bx3:int64", "input:0", ("B", 3)), ("1x:B", "1x", ("B",)),
                    ("steps::int64", "steps", ()), ("x:", "x", ()), ("/enc/in.0:2", "/enc/in.0", (2,))]


@pytest.mark.parametrize(("text", "name", "dims"), NAMES_AND_RANK_0)
def test_any_onnx_name_and_rank_0_parse_and_round_trip(text: str, name: str, dims: tuple[int | str, ...]) -> None:
    """ONNX names are any text (PyTorch exports number them) and inputs may be scalars: each parses to that name and
    those dims, and ``str`` of the spec (what the manifest stores) parses back to the same spec."""
    spec = parse_input_spec(text)
    assert (spec.name, spec.dims) == (name, dims)
    assert parse_input_spec(str(spec)) == spec


def test_a_rank_0_input_gets_a_0_d_example_array() -> None:
    """A scalar input's example value is a 0-d array of its dtype (what ONNX Runtime takes for a rank-0 input)."""
    feed = ModelSpec((parse_input_spec("steps::int64"), parse_input_spec("scale::float32"))).example_feed(1)
    assert feed["steps"].shape == () and feed["steps"].dtype == np.int64
    assert isinstance(feed["scale"], np.ndarray) and feed["scale"].shape == () and feed["scale"].dtype == np.float32


def test_dim_ranges() -> None:
    assert parse_dim_range("S=1:128:512") == ("S", DimRange(1, 128, 512))
    assert parse_dim_range("S=64") == ("S", DimRange(64, 64, 64))
    for bad in ("S", "S=1:2", "S=a:b:c", "=1:2:3"):
        with pytest.raises(InputError, match="--dim"):
            parse_dim_range(bad)
    with pytest.raises(InputError, match="min <= opt <= max"):
        parse_dim_range("S=10:5:20")


def test_model_spec_requires_ranges_for_dynamic_dims() -> None:
    ids = parse_input_spec("ids:BxS:int64")
    with pytest.raises(InputError, match="--dim S=MIN:OPT:MAX"):
        ModelSpec((ids,))
    with pytest.raises(InputError, match="no --input uses"):
        ModelSpec((ids,), {"S": DimRange(1, 2, 3), "T": DimRange(1, 2, 3)})
    spec = ModelSpec((ids, parse_input_spec("attention_mask:BxS:int64")), {"S": DimRange(1, 16, 64)})
    feed = spec.example_feed(3)
    assert feed["ids"].shape == (3, 16) and feed["ids"].dtype.name == "int64"
    assert (feed["attention_mask"] == 1).all()


def test_buckets_are_sorted_and_deduplicated_or_rejected() -> None:
    assert parse_buckets("8,1,4,4,16") == (1, 4, 8, 16)
    assert parse_buckets([16, 1]) == (1, 16)
    for bad in ("0,4", "1,x", "", "1.5", "-1"):
        with pytest.raises(InputError, match="bucket"):
            parse_buckets(bad)


def test_integer_inputs_take_a_value_range_that_round_trips() -> None:
    types = parse_input_spec("token_type_ids:BxS:int64[0,2)")
    assert types == InputSpec("token_type_ids", ("B", "S"), "int64", (0, 2))
    assert parse_input_spec(str(types)) == types  # the manifest stores str(spec)
    ids = parse_input_spec("input_ids:BxS:int64")
    spec = ModelSpec((ids, types, parse_input_spec("attention_mask:BxS:int64")), {"S": DimRange(1, 64, 64)})
    feed = spec.example_feed(4, seed=3)
    assert set(np.unique(feed["token_type_ids"])) == {0, 1}  # both rows of a 2-row embedding, nothing past them
    assert (feed["input_ids"] == 0).all() and (feed["attention_mask"] == 1).all()
    assert types.describe_values() == "values in [0, 2)" and ids.describe_values() == "zeros"


@pytest.mark.parametrize(("text", "problem"), [("x:B:float32[0,2)", "integer dtypes"), ("x:B:int64[3,3)", "empty"),
                                               ("x:B:int64[0,2]", "unknown dtype"),
                                               ("x:B:uint8[0,300)", "does not fit uint8")])
def test_bad_value_ranges_are_rejected(text: str, problem: str) -> None:
    with pytest.raises(InputError, match=problem):
        parse_input_spec(text)


def test_float_inputs_get_seeded_normals_drawn_in_float32() -> None:
    """Float example inputs are seeded standard normals: the same seed gives the same values and another seed other
    values; a float32 input gets float32, a float16 input those same float32 draws rounded to float16, a bfloat16
    input (which ONNX Runtime takes as float32 here) the float32 draws themselves."""
    def feed(dtype: str, seed: int) -> np.ndarray:
        return ModelSpec((parse_input_spec(f"x:Bx3x16x16:{dtype}"),)).example_feed(2, seed=seed)["x"]

    x = feed("float32", 5)
    assert x.dtype == np.float32 and x.shape == (2, 3, 16, 16)
    assert np.array_equal(x, feed("float32", 5)) and not np.array_equal(x, feed("float32", 6))
    assert abs(float(x.mean())) < 0.1 and 0.9 < float(x.std()) < 1.1  # 1536 draws: mean ~0, std ~1
    half = feed("float16", 5)
    assert half.dtype == np.float16 and np.array_equal(half, x.astype(np.float16))
    bf16 = feed("bfloat16", 5)
    assert bf16.dtype == np.float32 and np.array_equal(bf16, x)
