"""Defaults once: what the command line, the profile schema, docs/profiles.md and the settings
dataclasses say a default is must agree, so that changing one of them alone fails here. The values live in
compiler/core/defaults.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import click
import pytest

from compiler.cli import cli
from compiler.core.profile import SCHEMA, bench_settings, build_settings, calibration_settings, export_settings
from compiler.core.settings import (
    BenchSettings,
    BuildSettings,
    CalibrationSettings,
    ExportSettings,
    GateSettings,
    ModelSource,
)
from tests.project import ROOT

PROFILES = (ROOT / "docs" / "profiles.md").read_text()

CALIBRATION = CalibrationSettings(precision="int8")
GATE = GateSettings()
BUILD = BuildSettings()
EXPORT = ExportSettings(source=ModelSource(factory="pkg.m:f"), out=Path("out"))

# where each default is stated: profile key (section.key, also docs/profiles.md's table) and command-line option,
# and the value the dataclass holds
STATED: list[tuple[str | None, str | None, Any]] = [
    ("export.rtol", "--rtol", EXPORT.rtol),
    ("export.atol", "--atol", EXPORT.atol),
    ("build.buckets", "--buckets", EXPORT.buckets),
    ("calibration.samples", "--calib-samples", CALIBRATION.samples),
    ("calibration.batch_size", "--calib-batch", CALIBRATION.batch_size),
    ("calibration.method", "--calib-method", CALIBRATION.method),
    ("calibration.percentile", "--percentile", CALIBRATION.percentile),
    ("calibration.max_accuracy_drop", "--max-accuracy-drop", GATE.max_accuracy_drop),
    ("calibration.min_cosine", "--min-cosine", GATE.min_cosine),
    ("calibration.max_fallback", "--max-fallback", GATE.max_fallback),
    ("calibration.fp32_rest", None, CALIBRATION.fp32_rest),
    ("build.precision", None, BUILD.precision),
    ("build.opt_level", "--opt-level", BUILD.opt_level),
    ("build.hardware_compat", None, BUILD.hardware_compat),
    ("build.tf32", "--tf32", BUILD.tf32),
    ("build.engine", None, BUILD.engine),
]


def _value(text: str) -> Any:
    """A default as written in prose ("512", "1e-3", "on", "[1, 4, 8, 16]", "1,4,8,16", "`true`") as a value."""
    text = text.strip().strip("`'\"").rstrip(".")
    if text.lower() in ("true", "on"):
        return True
    if text.lower() in ("false", "off"):
        return False
    numbers = re.fullmatch(r"\[?\s*(\d+(?:\s*,\s*\d+)+)\s*\]?", text)
    if numbers:
        return tuple(int(n) for n in numbers.group(1).split(","))
    try:
        return float(text)
    except ValueError:
        return text


def _stated_default(description: str) -> Any:
    found = re.search(r"default:? ([^);:,\s]+(?:, ?\d+)*\]?)", description)
    assert found, f"no default stated in {description!r}"
    return _value(found.group(1))


def _same(stated: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(stated, bool):
        return stated is expected
    if isinstance(expected, (int, float)) and isinstance(stated, float):
        return stated == pytest.approx(expected, rel=1e-12)
    return bool(stated == expected)


def _option_help(command: str, flag: str) -> str:
    params = cli.commands[command].params
    option = next(p for p in params if isinstance(p, click.Option) and flag in p.opts + p.secondary_opts)
    return option.help or ""


@pytest.mark.parametrize(("key", "flag", "expected"), STATED, ids=[k or f for k, f, _ in STATED])
def test_profile_schema_help_and_profile_docs_state_the_dataclass_default(key: str | None, flag: str | None,
                                                                     expected: Any) -> None:
    if key is not None:
        section, name = key.split(".")
        assert _same(_stated_default(SCHEMA[section][name][1]), expected), SCHEMA[section][name][1]
        row = re.search(rf"^\| `{re.escape(key)}` \| \w+ \| (.+) \|$", PROFILES, flags=re.M)
        assert row, f"docs/profiles.md lost {key}"
        if "default" in row.group(1):
            assert _same(_stated_default(row.group(1).replace("`none` (default)", "default none")), expected), \
                row.group(1)
    if flag is not None:
        text = _option_help("build", flag)
        assert _same(_stated_default(text), expected), f"trtc build {flag}: {text}"


def test_the_command_line_without_options_gives_the_dataclass_defaults() -> None:
    assert calibration_settings({}, "int8") == CALIBRATION
    assert build_settings({}, BUILD.buckets, "fp32") == BUILD
    assert export_settings({"model_factory": "pkg.m:f", "out": Path("out")}) == EXPORT


def test_bench_option_defaults_are_the_dataclass_defaults() -> None:
    context = cli.commands["bench"].make_context("bench", ["build/m"], resilient_parsing=True)
    assert bench_settings(context.params) == BenchSettings()
    # and --help shows those values
    shown = {p.name: p.default for p in cli.commands["bench"].params if isinstance(p, click.Option) and p.show_default}
    fields = {f.name: f.default for f in dataclasses.fields(BenchSettings)}
    assert shown["iterations"] == fields["iterations"] and shown["seed"] == fields["seed"]
    assert shown["max_regression"] == f"{fields['max_regression'] * 100:g}%"


def test_library_functions_default_to_the_same_values() -> None:
    """Functions users and tests call directly take the defaults the command line uses."""
    import inspect

    from calibration.data import calibration_data
    from calibration.statistics import CalibrationStats, amax_from_histogram
    from compiler.serve.load import engines_from_module

    def default(fn: Any, name: str) -> Any:
        return inspect.signature(fn).parameters[name].default

    assert default(calibration_data, "max_samples") == CALIBRATION.samples
    assert default(calibration_data, "batch_size") == CALIBRATION.batch_size
    assert default(amax_from_histogram, "percentile") == default(CalibrationStats.amax, "percentile") == \
        CALIBRATION.percentile
    assert tuple(default(engines_from_module, "buckets")) == EXPORT.buckets


def test_the_calibration_methods_are_the_ones_statistics_implements() -> None:
    """The command line, the settings and the profile offer exactly the amax methods calibration has."""
    from calibration.statistics import AMAX_METHODS
    from compiler.core import defaults

    assert set(AMAX_METHODS) == set(defaults.CALIB_METHODS)
