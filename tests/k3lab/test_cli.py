"""The command line lives in k3lab/ alone, and every command that loads a model goes through the one loader,
``analysis.runs.loading.load_run``."""

import ast
from pathlib import Path

from analysis.runs import loading as runs
from k3lab import cli

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_checkpoints" / "plain-residual"


def argparse_users(root: Path = ROOT) -> list[str]:
    """Modules of k3core, analysis and app that import argparse (library code takes arguments instead)."""
    out = []
    for package in ("k3core", "analysis", "app"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                if "argparse" in names:
                    out.append(path.relative_to(root).as_posix())
    return sorted(set(out))


def test_only_k3lab_parses_command_lines(tmp_path):
    assert argparse_users() == []
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "probe.py").write_text("def f():\n    from argparse import Namespace\n")
    assert argparse_users(tmp_path) == ["analysis/probe.py"]  # the check sees one inside a function


def test_report_inspect_and_generate_load_through_analysis_runs(monkeypatch, tmp_path, capsys):
    loaded = []
    load_run = runs.load_run

    def spy(path, *args, **kwargs):
        loaded.append(Path(path).name)
        return load_run(path, *args, **kwargs)

    monkeypatch.setattr(runs, "load_run", spy)
    assert cli.main(["generate", str(SAMPLE), "--tokens", "3", "--temperature", "0", "--prompt", "ab"]) == 0
    assert cli.main(["inspect", str(SAMPLE), "--sample", "mqar", "--max-tokens", "16"]) == 0
    out = str(tmp_path / "report")
    argv = ["report", str(SAMPLE), "--out", out, "--no-static", "--quiet", "--views", "density_allocation"]
    assert cli.main([*argv, "--max-tokens", "16"]) == 0
    assert loaded == ["plain-residual"] * 3
    assert cli.main(["nonsense"]) == 2 and "unknown command" in capsys.readouterr().err
