"""ONNX's own backend test cases through trtc: ``trtc export`` and ``run_passes`` must keep every case's meaning.

The cases are ONNX's node cases, regenerated from ``onnx.backend.test.case.node.collect_testcases()`` and written
out as ``onnx.backend.test.cmd_tools.generate_data`` writes them (``KIND/NAME/model.onnx`` and
``test_data_set_0/input_J.pb``, ``output_J.pb``), plus the cases onnx ships as files (``pytorch-converted``,
``pytorch-operator``, ``simple``). A case counts when ONNX Runtime itself reproduces its expected outputs (the
backend runner's rule: ``assert_allclose`` at the case's rtol/atol, 1e-3 and 1e-7 unless its ``data.json`` says
otherwise); each such case then goes, in this process, through

* ``trtc export MODEL --example-data INPUTS.npz --buckets 1`` (its real inputs as the example data; ``--input``
  only for the inputs whose shapes the file leaves open), the result run in ONNX Runtime against the expected
  outputs, and
* ``compiler.frontend.passes.run_passes(model, feeds)`` on the same inputs, its result judged the same way.

Each path ends in one outcome: ``preserved``, ``wrong`` (a result that misses the expected outputs), ``caught``
(trtc's own check found the passes changed the result: exit 3 or VerificationError), ``unloadable`` (a result
ONNX Runtime cannot load or run), ``traceback`` (any exception or exit code other than a one-line refusal) or
``refused`` (exit 2 / InputError with one line naming the problem).

    PYTHONPATH=. python -m tests.onnx_conformance --table docs/onnx-conformance.md

writes the table in docs/ (``--cases DIR`` keeps the generated cases, ``-k TEXT`` runs the cases whose name
holds TEXT, ``--jobs N`` runs them in N worker processes, 2 by default); ``tests/test_onnx_conformance.py`` runs the
same and asserts the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["Case", "CaseResult", "write_cases", "read_cases", "run_case", "run_cases", "run_suite", "table",
           "refusal_kind", "OUTCOMES", "SHIPPED_KINDS", "SERVABLE_REFUSALS"]

SHIPPED_KINDS = ("pytorch-converted", "pytorch-operator", "simple")
DEFAULT_RTOL, DEFAULT_ATOL = 1e-3, 1e-7  # the backend runner's defaults (onnx.backend.test.loader)
OUTCOMES = ("preserved", "wrong", "caught", "unloadable", "traceback", "refused")


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    directory: Path
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL


@dataclass
class CaseResult:
    case: Case
    ort: str  # "passes" or why ONNX Runtime fails the case itself (then nothing else runs)
    export: str = ""  # an OUTCOMES entry for `trtc export`
    export_detail: str = ""
    passes: str = ""  # an OUTCOMES entry for run_passes
    passes_detail: str = ""
    seconds: float = 0.0  # wall time
    cpu_seconds: float = 0.0  # CPU time of the process (all its threads) for the case
    extra: dict[str, Any] = field(default_factory=dict)


# --- the cases, written as onnx's generate_data writes them -------------------------------------------------------

def write_cases(root: Path) -> list[Case]:
    """Regenerate the node cases into ``root/node`` and copy the shipped kinds beside them; returns every case."""
    import onnx.backend.test as backend_test
    from onnx.backend.test.case import node

    with contextlib.redirect_stdout(io.StringIO()), _no_warnings():
        generated = node.collect_testcases()
    for case in generated:
        directory = root / case.kind / case.name
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        assert case.model is not None and case.data_sets
        (directory / "model.onnx").write_bytes(case.model.SerializeToString())
        if (case.rtol, case.atol) != (DEFAULT_RTOL, DEFAULT_ATOL):
            (directory / "data.json").write_text(json.dumps({"rtol": case.rtol, "atol": case.atol}))
        for i, (inputs, outputs) in enumerate(case.data_sets):
            data = directory / f"test_data_set_{i}"
            data.mkdir()
            for prefix, values, infos in (("input", inputs, case.model.graph.input),
                                          ("output", outputs, case.model.graph.output)):
                for j, value in enumerate(values):
                    (data / f"{prefix}_{j}.pb").write_bytes(_proto_of(value, infos[j]).SerializeToString())
    shipped = Path(backend_test.__file__).parent / "data"
    for kind in SHIPPED_KINDS:
        target = root / kind
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(shipped / kind, target)
    return read_cases(root)


def _proto_of(value: Any, info: onnx.ValueInfoProto) -> Any:
    """``value`` as generate_data serializes it for a value of ``info``'s type."""
    kind = info.type.WhichOneof("value")
    if kind == "map_type":
        return numpy_helper.from_dict(value, info.name)
    if kind == "sequence_type":
        return numpy_helper.from_list(value, info.name)
    if kind == "optional_type":
        return numpy_helper.from_optional(value, info.name)
    return value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(value, info.name)


def read_cases(root: Path) -> list[Case]:
    """Every case under ``root/KIND/NAME`` that has a model.onnx, in name order."""
    cases = []
    for kind in ("node", *SHIPPED_KINDS):
        for directory in sorted((root / kind).glob("*/model.onnx")) if (root / kind).is_dir() else []:
            directory = directory.parent
            rtol, atol = DEFAULT_RTOL, DEFAULT_ATOL
            if (directory / "data.json").is_file():
                data = json.loads((directory / "data.json").read_text())
                rtol, atol = data.get("rtol", rtol), data.get("atol", atol)
            cases.append(Case(kind, directory.name, directory, rtol, atol))
    return cases


def _load_value(path: Path, type_proto: onnx.TypeProto) -> Any:
    """A data set's value as the backend runner loads it (``Runner._load_proto``)."""
    content = path.read_bytes()
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        sequence = onnx.SequenceProto()
        sequence.ParseFromString(content)
        return numpy_helper.to_list(sequence)
    if kind == "optional_type":
        optional = onnx.OptionalProto()
        optional.ParseFromString(content)
        return numpy_helper.to_optional(optional)
    if kind == "map_type":
        mapping = onnx.MapProto()
        mapping.ParseFromString(content)
        return numpy_helper.to_dict(mapping)
    tensor = onnx.TensorProto()
    tensor.ParseFromString(content)
    return numpy_helper.to_array(tensor)


def _data_set(case: Case, model: onnx.ModelProto) -> tuple[dict[str, Any], list[Any]]:
    """Data set 0: the inputs by name (graph inputs that are not initializers, in order) and the outputs."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    data = case.directory / "test_data_set_0"
    feed = {}
    for j, info in enumerate(inputs):
        if (data / f"input_{j}.pb").is_file():
            feed[info.name] = _load_value(data / f"input_{j}.pb", info.type)
    outputs = [_load_value(data / f"output_{j}.pb", info.type) for j, info in enumerate(model.graph.output)
               if (data / f"output_{j}.pb").is_file()]
    return feed, outputs


# --- judging outputs ----------------------------------------------------------------------------------------------

def _similar(got: Any, want: Any, rtol: float, atol: float) -> None:
    """The backend runner's comparison (``Runner.assert_similar_outputs``); raises AssertionError."""
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise AssertionError(f"expected a sequence of {len(want)}, got {type(got).__name__}")
        for g, w in zip(got, want):
            _similar(g, w, rtol, atol)
        return
    if want is None or got is None:
        if want is not got:
            raise AssertionError(f"expected {want!r}, got {type(got).__name__}")
        return
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got.shape, want.shape, err_msg="shape")
    if want.dtype == object:
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_equal(got.dtype, want.dtype)
    if want.dtype.name == "bfloat16":
        rtol, got, want = max(rtol, 2**-6), got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _ort_run(model: str | Path | onnx.ModelProto, feed: dict[str, Any]) -> list[Any]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
    return list(session.run(None, feed))


def _matches(outputs: list[Any], want: list[Any], case: Case) -> str:
    """"" when ``outputs`` are the expected outputs, else why not (one line)."""
    if len(outputs) != len(want):
        return f"{len(outputs)} outputs, expected {len(want)}"
    for k, (got, expected) in enumerate(zip(outputs, want)):
        try:
            _similar(got, expected, case.rtol, case.atol)
        except AssertionError as err:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            return f"output {k}: " + " ".join(lines[:3])[:200]
    return ""


def _judged(model: str | Path | onnx.ModelProto, feed: dict[str, Any], want: list[Any], case: Case,
            ) -> tuple[str, str]:
    """(outcome, detail) of a model trtc returned: preserved, wrong or unloadable."""
    try:
        outputs = _ort_run(model, feed)
    except Exception as err:  # ONNX Runtime raises its own types for a model it cannot load or run
        return "unloadable", _first_line(err)
    why = _matches(outputs, want, case)
    return ("wrong", why) if why else ("preserved", "")


# --- the two paths ------------------------------------------------------------------------------------------------

def _input_options(model: onnx.ModelProto, feed: dict[str, Any]) -> list[str]:
    """``--input`` for each tensor input whose shape the file leaves open, from its real value (rank 0 included)."""
    from compiler.core.specs import DTYPES

    initializers = {t.name for t in model.graph.initializer}
    options = []
    for info in model.graph.input:
        if info.name in initializers or info.name not in feed or not info.type.HasField("tensor_type"):
            continue
        tensor_type = info.type.tensor_type
        declared = tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in tensor_type.shape.dim)
        value = feed[info.name]
        if declared or not isinstance(value, np.ndarray) or value.dtype.name not in DTYPES:
            continue  # declared in the file, or a type trtc refuses: trtc reads it from the file
        options += ["--input", f"{info.name}:{'x'.join(map(str, value.shape))}:{value.dtype.name}"]
    return options


def _export_outcome(case: Case, model: onnx.ModelProto, feed: dict[str, Any], want: list[Any], work: Path,
                    ) -> tuple[str, str]:
    from click.testing import CliRunner

    from compiler.cli import cli

    arrays = {name: value for name, value in feed.items() if isinstance(value, np.ndarray)}
    np.savez(work / "inputs.npz", **arrays)  # type: ignore[arg-type]
    out = work / "out"
    args = ["export", "-q", str(case.directory / "model.onnx"), "--example-data", str(work / "inputs.npz"),
            *_input_options(model, feed), "--buckets", "1", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    text = result.output.strip()
    if result.exit_code == 0:
        return _judged(out / "model.onnx", feed, want, case)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "traceback", _traceback_line(result.exception)
    lines = text.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]  # warnings may come before it
    if result.exit_code in (2, 3) and len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in text:
        return ("caught" if result.exit_code == 3 else "refused"), errors[0].removeprefix("error: ")
    return "traceback", f"exit {result.exit_code}: " + " | ".join(lines[-3:])[:300]


def _passes_outcome(case: Case, model: onnx.ModelProto, feed: dict[str, Any], want: list[Any]) -> tuple[str, str]:
    from compiler.core.errors import InputError, VerificationError
    from compiler.frontend.passes import run_passes

    try:
        folded, _ = run_passes(model, feeds=feed)
    except VerificationError as err:
        return "caught", _first_line(err)
    except InputError as err:
        return "refused", _first_line(err)
    except Exception as err:
        return "traceback", _traceback_line(err)
    return _judged(folded, feed, want, case)


def run_case(case: Case, work: Path) -> CaseResult:
    """One case: ONNX Runtime on the original first; where that reproduces the expected outputs, both paths."""
    start, cpu = time.perf_counter(), time.process_time()
    model = onnx.load(str(case.directory / "model.onnx"))
    feed, want = _data_set(case, model)
    try:
        why = _matches(_ort_run(case.directory / "model.onnx", feed), want, case)
    except Exception as err:  # ONNX Runtime's own failures: the case says nothing about trtc
        why = "fails: " + _first_line(err)
    if why:
        return CaseResult(case, why, seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
    result = CaseResult(case, "passes")
    work.mkdir(parents=True, exist_ok=True)
    try:
        result.export, result.export_detail = _export_outcome(case, model, feed, want, work)
        result.passes, result.passes_detail = _passes_outcome(case, onnx.load(str(case.directory / "model.onnx")),
                                                              feed, want)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.seconds, result.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return result


def run_suite(cases: list[Case], work: Path, jobs: int = 1, progress: bool = False) -> list[CaseResult]:
    """Every case, in this process or in ``jobs`` worker processes that each run their share of the cases one after
    the other (a process per case would cost seconds of start-up each); results in the order of ``cases``."""
    if jobs <= 1 or len(cases) < 2:
        return run_cases(cases, work, progress)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    shares = [cases[k::jobs] for k in range(jobs)]  # interleaved: the slow expanded cases spread over the workers
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_cases, share, work / f"worker{k}", progress and k == 0)
                   for k, share in enumerate(shares)]
        done = {(r.case.kind, r.case.name): r for f in futures for r in f.result()}
    return [done[(c.kind, c.name)] for c in cases]


def run_cases(cases: list[Case], work: Path, progress: bool = False) -> list[CaseResult]:
    """``cases`` one after the other in this process (its ONNX Runtime sessions as trtc makes them)."""
    import gc
    import importlib

    for module in ("compiler.cli", "compiler.frontend.folding"):  # torch, ONNX Runtime, onnx-graphsurgeon: loaded
        importlib.import_module(module)
    logging.getLogger("onnx_graphsurgeon").setLevel(logging.ERROR)
    # constant folding collects its reference cycles at once (gc.collect); with torch and ONNX Runtime loaded that
    # walks a million objects each time: frozen, they are left out (0.3 s less per case)
    gc.collect()
    gc.freeze()
    results = []
    with _no_warnings():
        for k, case in enumerate(cases):
            results.append(run_case(case, work / "case"))
            if progress and (k + 1) % 100 == 0:
                print(f"{k + 1}/{len(cases)}", file=sys.stderr, flush=True)
    return results


# The refusals issue 32 allows: value types trtc cannot serve (onnx_input_spec's and the spec parser's messages)
SERVABLE_REFUSALS = (
    ("sequence, map or optional input", re.compile(r"is an? (sequence|map|optional)\b")),
    ("element type TensorRT does not take", re.compile(r"which TensorRT does not take as an input")),
    ("zero-size dimension", re.compile(r"zero-size dimension")),
)


def refusal_kind(reason: str) -> str | None:
    """Which allowed kind of refusal ``reason`` is, or None for any other."""
    return next((kind for kind, pattern in SERVABLE_REFUSALS if pattern.search(reason)), None)


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__)[:300]


def _traceback_line(err: BaseException) -> str:
    """The exception and the innermost frame it came from."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return _first_line(err) + where


# --- the table ----------------------------------------------------------------------------------------------------

def table(results: list[CaseResult], seconds: float, generating: float, command: str, jobs: int) -> str:
    """docs/onnx-conformance.md: counts by outcome per path, refusals by kind, every refused case with its reason,
    and every case with an outcome other than preserved or refused."""
    import onnxruntime

    counted = [r for r in results if r.ort == "passes"]
    kinds = Counter(r.case.kind for r in results)
    lines = [
        "# ONNX conformance of trtc's export and graph passes",
        "",
        "ONNX's backend test cases (the node cases regenerated with onnx's own case generators, written out as "
        "`onnx.backend.test.cmd_tools.generate_data` writes them, plus the "
        f"{', '.join(f'`{k}`' for k in SHIPPED_KINDS)} cases onnx ships), each run through `trtc export` with its "
        "real inputs as `--example-data` and through `compiler.frontend.passes.run_passes` on the same inputs. A "
        "result counts as preserved when ONNX Runtime reproduces the case's expected outputs from it (onnx's backend "
        "runner's rule: rtol 1e-3, atol 1e-7). Cases that ONNX Runtime fails as they are say nothing about trtc and "
        "are left out; `tests/test_onnx_conformance.py` (marked `slow`) runs the same and fails on any outcome but "
        "these two and on refusals of other kinds.",
        "",
        f"Cases: {len(results):,} ({', '.join(f'{n:,} {k}' for k, n in kinds.items())}); ONNX Runtime "
        f"{onnxruntime.__version__} runs {len(counted):,} of them correctly (onnx {onnx.__version__}).",
        f"Measured with `{command}`: {seconds / 60:.1f} min of wall time on this machine's 2 CPU cores (shared with "
        f"other work at the time), {generating / 60:.1f} of them generating the cases; running them took "
        f"{sum(r.cpu_seconds for r in results) / 60:.1f} CPU-minutes in {jobs} worker process(es).",
        "",
        "| outcome | `trtc export` | `run_passes` |",
        "| --- | ---: | ---: |",
    ]
    meaning = {"preserved": "outputs preserved", "wrong": "wrong result, unnoticed",
               "caught": "wrong result caught by trtc's check (exit 3)",
               "unloadable": "result that ONNX Runtime cannot load or run", "traceback": "traceback",
               "refused": "one-line refusal (exit 2)"}
    export, passes = Counter(r.export for r in counted), Counter(r.passes for r in counted)
    for outcome in OUTCOMES:
        lines.append(f"| {meaning[outcome]} | {export[outcome]:,} | {passes[outcome]:,} |")
    lines.append(f"| total | {len(counted):,} | {len(counted):,} |")
    refused = [r for r in counted if r.export == "refused" or r.passes == "refused"]
    by_kind = Counter(refusal_kind(r.export_detail if r.export == "refused" else r.passes_detail) or "other"
                      for r in refused)
    lines += ["", "## Refusals by kind", "", "The value types trtc cannot serve: its engines and servers take tensors "
              "of the element types TensorRT takes as inputs, of sizes of at least 1.", "", "| kind | cases |",
              "| --- | ---: |"]
    lines += [f"| {kind} | {n:,} |" for kind, n in by_kind.most_common()]
    lines += ["", "## Cases trtc refuses", "",
              "With the line `trtc export` prints (`run_passes`, given the inputs, runs these cases and preserves "
              "their outputs unless the line says otherwise).", "", "| case | reason |", "| --- | --- |"]
    for r in refused:
        reason = r.export_detail if r.export == "refused" else f"(`trtc export`: {r.export})"
        if r.passes != "preserved":
            reason += f" (`run_passes`: {r.passes}: {r.passes_detail})"
        lines.append(f"| {r.case.kind}/{r.case.name} | {_cell(reason)} |")
    bad = [r for r in counted if {r.export, r.passes} - {"preserved", "refused"}]
    if bad:
        lines += ["", "## Cases with another outcome", "", "| case | `trtc export` | `run_passes` |",
                  "| --- | --- | --- |"]
        for r in bad:
            lines.append(f"| {r.case.kind}/{r.case.name} | {r.export}: {_cell(r.export_detail)} | "
                         f"{r.passes}: {_cell(r.passes_detail)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="write the markdown table here (docs/onnx-conformance.md)")
    parser.add_argument("--cases", type=Path, help="generate the cases here and keep them (default: a temporary "
                        "folder); an existing folder of cases is read as it is")
    parser.add_argument("-k", dest="pattern", default="", help="run only the cases whose name holds this text")
    parser.add_argument("--json", type=Path, help="write every case's outcome here")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trtc-conformance-") as scratch:
        root = args.cases or Path(scratch) / "cases"
        cases = read_cases(root) if args.cases and (root / "node").is_dir() else write_cases(root)
        generating = time.perf_counter() - start
        cases = [c for c in cases if args.pattern in c.name]
        results = run_suite(cases, Path(scratch) / "work", jobs=args.jobs, progress=True)
    seconds = time.perf_counter() - start
    counted = [r for r in results if r.ort == "passes"]
    for path in ("export", "passes"):
        print(path, dict(Counter(getattr(r, path) for r in counted)))
    if args.json:
        args.json.write_text(json.dumps([{"case": f"{r.case.kind}/{r.case.name}", "ort": r.ort, "export": r.export,
                                          "export_detail": r.export_detail, "passes": r.passes,
                                          "passes_detail": r.passes_detail, "seconds": round(r.seconds, 3),
                                          "cpu_seconds": round(r.cpu_seconds, 3)}
                                         for r in results], indent=1))
    if args.table:
        command = f"PYTHONPATH=. python -m tests.onnx_conformance --table {args.table}" + \
            (f" --jobs {args.jobs}" if args.jobs != 2 else "")
        args.table.write_text(table(results, seconds, generating, command, args.jobs))
    print(f"{len(results)} cases, {len(counted)} counted, {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
