"""ONNX's own backend test cases through `trtc export` and `run_passes` (tests/onnx_conformance.py runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.onnx_conformance import refusal_kind, run_suite, write_cases


@pytest.mark.slow
def test_every_case_onnx_runtime_passes_keeps_its_outputs_or_is_a_fair_refusal(tmp_path: Path) -> None:
    """Regenerates ONNX's node cases (and copies the shipped pytorch-converted, pytorch-operator and simple ones) and
    runs, in two worker processes, every case whose expected outputs ONNX Runtime reproduces through `trtc export`
    (its real inputs as --example-data) and through run_passes. Proves, for each such case and each path: the result
    reproduces the expected outputs in ONNX Runtime (rtol 1e-3, atol 1e-7, as onnx's backend runner), or trtc refused
    it in one line (exit 2) for a value type it cannot serve (a sequence, map or optional input, an element type
    TensorRT does not take, a zero-size dimension). No wrong result (caught or not), no result ONNX Runtime rejects,
    no traceback. The floor on counted cases keeps a broken generator or ONNX Runtime from passing it vacuously."""
    results = run_suite(write_cases(tmp_path / "cases"), tmp_path / "work", jobs=2)
    counted = [r for r in results if r.ort == "passes"]
    assert len(counted) > 1400, f"only {len(counted)} of {len(results)} cases run in ONNX Runtime"
    for path in ("export", "passes"):
        bad = [f"{r.case.kind}/{r.case.name}: {getattr(r, path)}: {getattr(r, path + '_detail')}" for r in counted
               if getattr(r, path) not in ("preserved", "refused")]
        assert not bad, f"{path}: {len(bad)} cases\n" + "\n".join(bad)
        unfair = [f"{r.case.kind}/{r.case.name}: {getattr(r, path + '_detail')}" for r in counted
                  if getattr(r, path) == "refused" and refusal_kind(getattr(r, path + "_detail")) is None]
        assert not unfair, f"{path}: refusals of other kinds\n" + "\n".join(unfair)
