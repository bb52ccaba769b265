"""README stays true to the code: the profile schema and exit codes it documents are the ones in use."""

from __future__ import annotations

import re
from pathlib import Path

from compiler.errors import EXIT_CODES
from compiler.profile import SCHEMA

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
