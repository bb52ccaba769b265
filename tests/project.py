"""Where the project's files are, for tests that read them (README, docs, pyproject, benchmarks, typings)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
