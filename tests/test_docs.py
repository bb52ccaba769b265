"""The README and docs/ stay true to the code: the quick start, the exit codes, the profile keys, the links, and
every `trtc` command shown in the README's code blocks, which a test runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from compiler.cli import cli
from compiler.core.errors import EXIT_CODES
from compiler.core.profile import SCHEMA

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PROFILES = (ROOT / "docs" / "profiles.md").read_text()

# Code blocks whose commands are not run: a CI workflow runs in its own repository layout, Python is not a command.
NOT_RUN = {"yaml", "python", "toml"}


def commands_in(text: str) -> list[list[str]]:
    """Every `trtc ...` line of the page's code blocks (backslash continuations joined, comments dropped), in order,
    as argument lists without the leading `trtc`."""
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
        if lang in NOT_RUN:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.startswith("trtc "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def readme_commands() -> list[list[str]]:
    return commands_in(README)


def test_readme_quick_start_is_the_two_make_commands() -> None:
    quick = README.split("## Quick start")[1].split("\n## ")[0]
    assert re.findall(r"^make (\w+)", quick, flags=re.M) == ["demo", "test"]


def test_readme_is_a_guide_of_at_most_300_lines() -> None:
    assert len(README.splitlines()) <= 300


def test_readme_exit_codes_match_the_cli() -> None:
    rows = dict(re.findall(r"^\| (\d) \| (.+) \|$", README, flags=re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES


def test_docs_profiles_documents_every_profile_key_with_its_type() -> None:
    documented = dict(re.findall(r"^\| `(\w+\.\w+)` \| (\w+) \|", PROFILES, flags=re.M))
    in_code = {f"{section}.{key}": types for section, keys in SCHEMA.items() for key, (types, _) in keys.items()}
    assert set(documented) == set(in_code)
    wrong = {key: kind for key, kind in documented.items() if kind not in {t.__name__ for t in in_code[key]}}
    assert not wrong, f"types in docs/profiles.md that the schema does not accept: {wrong}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
            continue
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_shown_parse(page: Path) -> None:
    """Every command of the page's code blocks names a real command and options it takes, with valid values."""
    commands = commands_in(page.read_text())
    if page.name == "README.md":
        assert len(commands) >= 10, "README lost its command examples"
    for args in commands:
        command = cli.commands.get(args[0])
        assert command is not None, f"trtc {args[0]}: no such command"
        command.make_context(args[0], args[1:])  # raises a UsageError for an unknown option or a bad value


@pytest.fixture
def readme_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory README's commands expect: model.pt (an ExportedProgram of the digits CNN, untrained,
    with a dynamic batch), calib.npz and eval.npz ({"images": N x 1 x 8 x 8}, no labels: the gate is on cosine)."""
    import torch

    from examples.models import resnet_digits

    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(resnet_digits().eval(), (torch.randn(2, 1, 8, 8),), dynamic_shapes=({0: batch},))
    torch.export.save(program, tmp_path / "model.pt")
    rng = np.random.default_rng(0)
    for name in ("calib", "eval"):
        np.savez(tmp_path / f"{name}.npz", images=rng.standard_normal((32, 1, 8, 8)).astype(np.float32))
    monkeypatch.chdir(tmp_path)
    return tmp_path


# trtc bench's timing options for the test: a few runs per row instead of 2 s each (nothing else is changed)
FAST_BENCH = ["-n", "3", "--min-seconds", "0", "--warmup", "1", "--warmup-seconds", "0", "--no-plot"]


@pytest.mark.slow
def test_readme_commands_run(readme_files: Path) -> None:
    """README's commands, run as written and in order in a directory holding the files they name.

    Where TensorRT is not installed, `trtc build` without `--engine none` and `trtc rebuild` must fail as documented
    (exit 4, one line saying TensorRT is not installed: everything but the engines written), and `trtc check` must
    call the engines stale (exit 1); every other command must succeed. With TensorRT every command must succeed.
    `trtc serve` runs Triton in the foreground until Ctrl-C: tests/compiler/pipeline/test_triton_server.py runs it
    on a build, answers its curl line and stops it; here it is only parsed (test_commands_shown_parse).
    """
    runner = CliRunner()
    no_tensorrt = False
    for args in readme_commands():
        name = args[0]
        if name == "serve":
            continue
        run = [*args, *FAST_BENCH] if name == "bench" else args
        result = runner.invoke(cli, run)
        shown = f"trtc {shlex.join(args)}: exit {result.exit_code}\n{result.output}"
        if name == "build" and "--engine" not in args and result.exit_code == 4:
            no_tensorrt = True  # the first build says whether engines can be built here
        expected = 0
        if no_tensorrt and (name == "rebuild" or (name == "build" and "--engine" not in args)):
            expected = 4
            assert [line for line in result.output.splitlines()
                    if line.startswith("error: TensorRT is not installed")], shown
        elif no_tensorrt and name == "check":
            expected = 1
            assert "stale" in result.output, shown
        assert result.exit_code == expected, shown
    assert (readme_files / "build" / "m" / "model.int8.onnx").is_file()
    assert (readme_files / "build" / "fp32" / "model.fp16.onnx").is_file()
    assert (readme_files / "build" / "m" / "report" / "bench.json").is_file()
    assert (readme_files / "models" / "m" / "config.pbtxt").is_file()


def test_the_architecture_page_names_every_module_and_nothing_that_is_gone() -> None:
    """docs/architecture.md matches the code: every module of compiler/ and calibration/ is named there (as
    `module` in its package's row, or as a path), and every path it names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w/.]+)`", text)) | set(re.findall(r"([\w/]+\.py)", text))
    missing = []
    for package in ("compiler", "calibration"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.stem in ("__init__", "__main__"):
                continue
            relative = path.relative_to(ROOT).as_posix()
            short = path.relative_to(ROOT / package).as_posix()
            if not {path.stem, relative, short, path.parent.name + "/"} & named:
                missing.append(relative)
    assert missing == []
    paths = [p for p in re.findall(r"((?:compiler|calibration|benchmarks|tests)/[\w/]+(?:\.py)?)", text)]
    assert [p for p in paths if not (ROOT / p).exists()] == []

