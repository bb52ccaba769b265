"""``trtc bench --baseline``: comparing a run with an earlier bench.json of the same build.

A row (backend/precision, bucket) whose P50 rose or whose throughput fell by more than
``--max-regression`` is a ``Regression``; ``BenchReport.raise_for_regressions`` turns any into an exit
code of 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiler.bench.report import REPORT_KIND, Regression
from compiler.core.errors import InputError
from compiler.core.files import read_json
from compiler.core.manifest import Manifest

__all__ = ["find_regressions", "parse_percent", "read_baseline"]


def parse_percent(text: str | float) -> float:
    """``"5%"`` or ``"5"`` -> 0.05 (always percent)."""
    value = str(text).strip().removesuffix("%").strip()
    try:
        number = float(value)
    except ValueError:
        raise InputError(f"--max-regression {text!r} is not a percentage: write e.g. 5%") from None
    if not 0 <= number < 1000:
        raise InputError(f"--max-regression {text!r}: use a percentage from 0% to 1000%")
    return number / 100


def read_baseline(path: Path, manifest: Manifest) -> dict[str, Any]:
    try:
        baseline = read_json(path)
    except (OSError, ValueError) as err:
        raise InputError(f"--baseline {path}: not a readable JSON file ({err})") from err
    if not isinstance(baseline, dict) or baseline.get("kind") != REPORT_KIND:
        raise InputError(f"--baseline {path}: not a trtc bench report (report/bench.json)")
    old = (baseline.get("build") or {}).get("source") or {}
    new = manifest.source.sha256 if manifest.source is not None else ""
    if old.get("sha256") and new and old["sha256"] != new:
        raise InputError(f"--baseline {path} measured another model ({old.get('path')}); compare runs of the same "
                         "build")
    return baseline


def find_regressions(current: dict[str, Any], baseline: dict[str, Any], threshold: float,
                     ) -> tuple[list[Regression], int, list[str]]:
    """Rows (backend/precision, bucket) in both reports whose P50 rose or throughput fell by more than
    ``threshold`` (a fraction). Returns the regressions, how many rows were compared, and the rows that
    could not be (absent from one report, or measured on another device)."""
    old = {(r["name"], r["bucket"]): r for r in baseline.get("results") or []}
    regressions: list[Regression] = []
    compared = 0
    not_compared: list[str] = []
    for r in current["results"]:
        key = (r["name"], r["bucket"])
        before = old.pop(key, None)
        if before is None:
            not_compared.append(f"{r['name']} bucket {r['bucket']}: not in the baseline")
            continue
        if before.get("device") != r["device"]:
            not_compared.append(f"{r['name']} bucket {r['bucket']}: baseline ran on {before.get('device')}")
            continue
        compared += 1
        p50_old, p50_new = before["latency_ms"]["p50"], r["latency_ms"]["p50"]
        if p50_old > 0 and (p50_new - p50_old) / p50_old > threshold:
            regressions.append(Regression(r["name"], r["bucket"], "p50_ms", p50_old, p50_new,
                                          (p50_new - p50_old) / p50_old))
        # from each report's own P50, the statistic of every column (a baseline may predate that)
        tp_old = r["bucket"] * 1000.0 / p50_old if p50_old > 0 else 0.0
        tp_new = r["bucket"] * 1000.0 / p50_new if p50_new > 0 else 0.0
        if tp_old > 0 and (tp_old - tp_new) / tp_old > threshold:
            regressions.append(Regression(r["name"], r["bucket"], "throughput", tp_old, tp_new,
                                          (tp_old - tp_new) / tp_old))
    not_compared += [f"{name} bucket {bucket}: in the baseline only" for name, bucket in old]
    return regressions, compared, not_compared
