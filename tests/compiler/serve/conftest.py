"""Fixtures of the serving runtime's tests: build directories made once per module, engines over the MLP and the
transformer, and a record of the buckets the CPU contexts run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compiler.backends.onnxrt import OrtCpuContext
from compiler.serve import engines as runtime
from compiler.serve.engines import Engines
from compiler.serve.load import load
from tests.builds import MODELS, build_directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime")
    return {name: build_directory(root / name, name) for name in MODELS}


@pytest.fixture(scope="module")
def mlp_engines(dirs: dict[str, Path]) -> Iterator[runtime.Engines]:
    with load(dirs["mlp"], backend="onnxruntime", device="cpu") as engines:
        yield engines


@pytest.fixture
def buckets_run(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bucket, rows) of every chunk the CPU contexts run."""
    seen: list[tuple[int, int]] = []
    original = OrtCpuContext.run

    def spy(self: Any, bucket: int, call: Any, start: int, stop: int, host: bool) -> None:
        seen.append((bucket, stop - start))
        original(self, bucket, call, start, stop, host)

    monkeypatch.setattr(OrtCpuContext, "run", spy)
    return seen

@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """The MLP on ONNX Runtime's CPU provider: what the batchers' tests batch for."""
    directory = build_directory(tmp_path_factory.mktemp("batcher") / "mlp", "mlp")
    with load(directory, backend="onnxruntime", device="cpu") as engines:
        yield engines



@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    directory = build_directory(tmp_path_factory.mktemp("process-batcher") / "tr", "transformer_encoder")
    with load(directory, backend="onnxruntime", device="cpu") as engines:
        yield engines
