from __future__ import annotations

from pathlib import Path

import pytest

from compiler.core.errors import InputError
from compiler.core.profile import load_profile
from tests.project import ROOT


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


def test_bundled_profiles_load() -> None:
    for path in (ROOT / "profiles").glob("*.toml"):
        profile = load_profile(path)
        assert profile["build"]["buckets"]
        assert Path(profile["build"]["out"]).is_absolute()  # relative to the profile file


@pytest.mark.parametrize(("text", "message"), [
    ('[model]\nfactory = "a:b"\nshape = 1\n', "unknown key model.shape"),
    ('[modle]\nfactory = "a:b"\n', "unknown section [modle]"),
    ('[model]\nfactory = "a:b"\n[build]\nbuckets = "1,4"\n', "build.buckets = '1,4': expected list"),
    ('[model]\nfactory = "a:b"\n[build]\nmulti_profile = 1\n', "build.multi_profile = 1: expected bool"),
    ('[model]\nsource = "m.pt"\nfactory = "a:b"\n', "keep one"),
    ("[build]\nbuckets = [1]\n", "[model] needs source"),
    ("[model\n", "not valid TOML"),
])
def test_profile_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InputError) as err:
        load_profile(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_paths_resolve_against_the_profile_directory(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\nsource = "models/m.pt"\n[calibration]\ndata = "random"\n')
    profile = load_profile(path)
    assert profile["model"]["source"] == str(tmp_path / "models" / "m.pt")
    assert profile["calibration"]["data"] == "random"


def test_fp32_rest_from_the_profile_and_the_command_line(tmp_path: Path) -> None:
    from compiler.core.profile import calibration_settings

    profile = load_profile(write(tmp_path, '[model]\nfactory = "a:b"\n[calibration]\nfp32_rest = true\n'))
    assert calibration_settings({}, "int8", profile).fp32_rest is True
    assert calibration_settings({}, "int8").fp32_rest is False  # FP16 rest by default
    assert calibration_settings({"fp32_rest": True}, "int8").fp32_rest is True
    with pytest.raises(InputError, match="fp32_rest = 'yes': expected bool"):
        load_profile(write(tmp_path, '[model]\nfactory = "a:b"\n[calibration]\nfp32_rest = "yes"\n'))
