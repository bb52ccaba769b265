"""Input specs: names, shapes with dynamic dimensions, dtypes, and batch buckets.

``images:Bx3x224x224:float32`` is an input named ``images`` whose first dimension is the
dynamic batch ``B``; any other letter (``S`` for a sequence length, say) is a dynamic
dimension whose range comes from ``--dim S=1:128:512`` (min:opt:max). An integer input may
carry the range of values its example inputs take, ``token_type_ids:BxS:int64[0,2)``
(low inclusive, high exclusive); without one its example values are zeros. A name is any
text, as ONNX allows (``0``, ``input:0``: the spec is read from the right, so a name with a
colon needs the DTYPE); an empty SHAPE is a rank-0 (scalar) input, ``steps::int64``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from compiler.core.errors import InputError

__all__ = ["DimRange", "InputSpec", "ModelSpec", "parse_input_spec", "parse_dim_range", "parse_buckets",
           "BATCH_DIM", "DTYPES", "INTEGER_DTYPES"]

BATCH_DIM = "B"
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
_DTYPE_TEXT = re.compile(r"^[a-z]+[0-9]*(\[.*)?$")  # what the last part of a spec looks like when it is a DTYPE
_DIM = re.compile(r"^([0-9]+|[A-Za-z][A-Za-z0-9_]*)$")
_VALUES = re.compile(r"^([a-z0-9]+)\[(-?[0-9]+),(-?[0-9]+)\)$")
INTEGER_DTYPES = ("int64", "int32", "int8", "uint8")


@dataclass(frozen=True)
class DimRange:
    """The range of a dynamic dimension, as TensorRT's optimization profiles want it."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not (1 <= self.min <= self.opt <= self.max):
            raise InputError(f"dimension range {self.min}:{self.opt}:{self.max} must satisfy 1 <= min <= opt <= max")

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


@dataclass(frozen=True)
class InputSpec:
    """One model input. ``dims`` holds ints for fixed sizes and names for dynamic ones."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str = "float32"
    values: tuple[int, int] | None = None  # [low, high) of example values, integer inputs only

    def __str__(self) -> str:
        values = f"[{self.values[0]},{self.values[1]})" if self.values else ""
        return f"{self.name}:{'x'.join(str(d) for d in self.dims)}:{self.dtype}{values}"

    def describe_values(self) -> str:
        """What example values this input gets, for error messages."""
        if self.values:
            return f"values in [{self.values[0]}, {self.values[1]})"
        if self.dtype == "bool" or self._is_mask:
            return "ones"
        return "zeros" if self.dtype in INTEGER_DTYPES else "standard normal values"

    @property
    def _is_mask(self) -> bool:
        return self.dtype in INTEGER_DTYPES and "mask" in self.name.lower() and self.values is None

    @property
    def dynamic_dims(self) -> tuple[str, ...]:
        return tuple(d for d in self.dims if isinstance(d, str))

    def shape(self, values: dict[str, int]) -> tuple[int, ...]:
        """The concrete shape with each dynamic dimension set from ``values``."""
        return tuple(values[d] if isinstance(d, str) else d for d in self.dims)


@dataclass(frozen=True)
class ModelSpec:
    """All inputs of a model plus the ranges of its non-batch dynamic dimensions."""

    inputs: tuple[InputSpec, ...]
    dims: dict[str, DimRange] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise InputError(f"input names repeat in {names}: give each --input a distinct name")
        used = {d for i in self.inputs for d in i.dynamic_dims}
        missing = sorted(used - set(self.dims) - {BATCH_DIM})
        if missing:
            raise InputError(f"dynamic dimension(s) {', '.join(missing)} have no range: add --dim "
                             f"{missing[0]}=MIN:OPT:MAX")
        unused = sorted(set(self.dims) - used)
        if unused:
            raise InputError(f"--dim {unused[0]} names a dimension that no --input uses; inputs are "
                             f"{', '.join(str(i) for i in self.inputs)}")
        if BATCH_DIM in self.dims:
            raise InputError("the batch dimension B takes its range from --buckets, not --dim")

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    def sample_bytes(self) -> int:
        """Bytes of one sample of every input with each dynamic dimension at its max (the batch at 1)."""
        values = {name: r.max for name, r in self.dims.items()}
        values[BATCH_DIM] = 1
        total = 0
        for spec in self.inputs:
            n = 2 if spec.dtype == "bfloat16" else np.dtype(spec.dtype).itemsize
            for d in spec.shape(values):
                n *= d
            total += n
        return total

    def opt_values(self, batch: int) -> dict[str, int]:
        """Dimension values for a run at ``batch`` with every other dynamic dimension at its opt."""
        values = {name: r.opt for name, r in self.dims.items()}
        values[BATCH_DIM] = batch
        return values

    def example_feed(self, batch: int, seed: int = 0, values: dict[str, int] | None = None,
                     ) -> dict[str, np.ndarray]:
        """Seeded example inputs: normal floats; integers from the spec's range, else zeros; ones for masks.

        Zeros are an index every embedding and gather accepts; a range such as ``[0,2)`` on the
        input gives random values in it instead. An integer input whose name contains ``mask`` (and
        that has no range) gets ones so that attention sees every position.
        """
        rng = np.random.default_rng(seed)
        values = values or self.opt_values(batch)
        feed: dict[str, np.ndarray] = {}
        for spec in self.inputs:
            shape = spec.shape(values)
            if spec.dtype in ("float32", "float16", "bfloat16"):
                # drawn in float32: float64 draws cost twice the time and memory for values cast down anyway
                draws = np.asarray(rng.standard_normal(shape, dtype=np.float32))
                feed[spec.name] = draws if spec.dtype == "bfloat16" else draws.astype(spec.dtype, copy=False)
            elif spec.dtype == "bool":
                feed[spec.name] = np.ones(shape, dtype=bool)
            elif spec.values is not None:
                feed[spec.name] = np.asarray(rng.integers(spec.values[0], spec.values[1], size=shape)).astype(
                    spec.dtype)
            elif spec._is_mask:
                feed[spec.name] = np.ones(shape, dtype=spec.dtype)
            else:
                feed[spec.name] = np.zeros(shape, dtype=spec.dtype)
        return feed


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``NAME:SHAPE[:DTYPE[[LOW,HIGH)]]``, e.g. ``images:Bx3x224x224:float32`` or ``ids:BxS:int64[0,2)``.

    Read from the right: the last part is the DTYPE when it looks like one (lower-case letters, then digits), the
    part before it the SHAPE (empty for rank 0), and the rest, colons included, the name. ``str(InputSpec)`` always
    writes the DTYPE, so it parses back whatever the name.
    """
    how = "write NAME:SHAPE[:DTYPE], e.g. images:Bx3x224x224:float32 or token_type_ids:BxS:int64[0,2)"
    parts = text.split(":")
    if len(parts) < 2:
        raise InputError(f"input spec {text!r} does not parse: {how}")
    if len(parts) >= 3 and _DTYPE_TEXT.match(parts[-1]):
        name, shape_text, dtype = ":".join(parts[:-2]), parts[-2], parts[-1]
    else:
        name, shape_text, dtype = ":".join(parts[:-1]), parts[-1], "float32"
    if not name:
        raise InputError(f"input spec {text!r} has no name: {how}")
    values: tuple[int, int] | None = None
    ranged = _VALUES.match(dtype)
    if ranged:
        dtype, values = ranged.group(1), (int(ranged.group(2)), int(ranged.group(3)))
        if dtype not in INTEGER_DTYPES:
            raise InputError(f"input spec {text!r}: a value range [LOW,HIGH) applies to integer dtypes "
                             f"({', '.join(INTEGER_DTYPES)}), not {dtype}")
        if values[0] >= values[1]:
            raise InputError(f"input spec {text!r}: the value range [{values[0]},{values[1]}) is empty; "
                             "write [LOW,HIGH) with LOW < HIGH")
        info = np.iinfo(np.dtype(dtype))
        if values[0] < info.min or values[1] - 1 > info.max:
            raise InputError(f"input spec {text!r}: the value range [{values[0]},{values[1]}) does not fit {dtype} "
                             f"([{info.min},{info.max}])")
    if dtype not in DTYPES:
        raise InputError(f"input spec {text!r}: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    dims: list[int | str] = []
    for part in shape_text.split("x") if shape_text else []:  # an empty SHAPE: rank 0
        if not _DIM.match(part):
            raise InputError(f"input spec {text!r}: dimension {part!r} is neither a positive integer nor a "
                             f"letter; {how}")
        if part.isdigit():
            if int(part) < 1:
                raise InputError(f"input spec {text!r}: a zero-size dimension; TensorRT takes no empty inputs, so each "
                                 "size must be at least 1")
            dims.append(int(part))
        else:
            dims.append(part)
    return InputSpec(name, tuple(dims), dtype, values)


def parse_dim_range(text: str) -> tuple[str, DimRange]:
    """Parse ``S=1:128:512`` (min:opt:max) or ``S=128`` (fixed)."""
    name, sep, rng = text.partition("=")
    parts = rng.split(":")
    if not sep or not _DIM.match(name) or name.isdigit() or len(parts) not in (1, 3) or \
            not all(p.isdigit() for p in parts):
        raise InputError(f"--dim {text!r} does not parse: write NAME=MIN:OPT:MAX, e.g. S=1:128:512")
    values = [int(p) for p in parts]
    return name, DimRange(values[0], values[len(values) // 2], values[-1])


def parse_buckets(text: str | list[int]) -> tuple[int, ...]:
    """Parse ``1,4,8,16``. Rejects non-positive or non-integer values; sorts and removes repeats.

    Unsorted or repeated lists are normalised (the caller logs that), since the intent is clear.
    """
    items = text if isinstance(text, list) else [p.strip() for p in str(text).split(",")]
    buckets: list[int] = []
    for item in items:
        if isinstance(item, bool) or not (isinstance(item, int) or (isinstance(item, str) and item.isdigit())):
            raise InputError(f"bucket {item!r} is not a positive integer: write --buckets like 1,4,8,16")
        value = int(item)
        if value < 1:
            raise InputError(f"bucket {value} is not a positive integer: write --buckets like 1,4,8,16")
        buckets.append(value)
    if not buckets:
        raise InputError("no buckets given: write --buckets like 1,4,8,16")
    return tuple(sorted(set(buckets)))
