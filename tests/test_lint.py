"""The code base passes ruff (the project's linter and formatter) with the settings in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401

        cmd = [sys.executable, "-m", "ruff"]
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.skip("ruff is not installed")
        cmd = ["ruff"]
    return subprocess.run([*cmd, *args, "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)


def test_ruff_check_passes():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_check_passes():
    result = _ruff("format", "--check")
    assert result.returncode == 0, "run `ruff format` on these files:\n" + result.stdout + result.stderr
