"""README stays true to the code: the profile schema and exit codes it documents are the ones in use."""

from __future__ import annotations

import re
from pathlib import Path

from compiler.core.errors import EXIT_CODES
from compiler.core.profile import SCHEMA

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_readme_documents_every_profile_key() -> None:
    documented = set(re.findall(r"^\| `(\w+\.\w+)` \|", README, flags=re.M))
    in_code = {f"{section}.{key}" for section, keys in SCHEMA.items() for key in keys}
    assert documented == in_code


def test_readme_exit_codes_match_the_cli() -> None:
    rows = dict(re.findall(r"^\| (\d) \| (.+) \|$", README, flags=re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES


def test_readme_quick_start_is_the_two_make_commands() -> None:
    quick = README.split("## Quick start")[1].split("##")[0]
    assert re.findall(r"^make (\w+)", quick, flags=re.M) == ["demo", "test"]


def test_readme_export_example_runs(tmp_path: Path) -> None:
    """The transformer export command of README's "Models" section, run as written (output redirected)."""
    import shlex

    from click.testing import CliRunner

    from compiler.cli import cli

    block = re.search(r"```\n(trtc export --model-factory examples\.models:transformer_encoder.*?)\n```", README,
                      flags=re.S)
    assert block, "README lost its transformer export example"
    args = shlex.split(block.group(1).replace("\\\n", " "))[1:]
    args[args.index("--out") + 1] = str(tmp_path / "tr")
    result = CliRunner().invoke(cli, [*args, "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tr" / "model.onnx").is_file()
