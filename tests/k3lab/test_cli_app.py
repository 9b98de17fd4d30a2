"""`k3lab app`: the streamlit command it builds (listen address, upload limit) and the settings it passes on."""

from __future__ import annotations

from pathlib import Path

from app.server.settings import HOME_ENV, MAX_UPLOAD_ENV, ROOTS_ENV, configured_roots, max_upload_mb
from k3lab.app import app_command, app_parser
from k3lab.app import main as cmd_app


def _option(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, cmd
    return cmd[cmd.index(name) + 1]


def test_app_listens_on_localhost_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    cmd, env = app_command(app_parser().parse_args([]), {})
    assert cmd[1:3] == ["-m", "app.server.serve"]  # `streamlit run app/main.py` with the libraries preloaded
    assert _option(cmd, "--server.address") == "127.0.0.1"
    assert _option(cmd, "--server.maxUploadSize") == "4096" and env[MAX_UPLOAD_ENV] == "4096"
    assert _option(cmd, "--server.port") == "8501"
    assert env[HOME_ENV] == str((tmp_path / ".k3lab").resolve())  # ~/.k3lab of the HOME given
    assert env[ROOTS_ENV] == str(tmp_path.resolve())  # the folder the app is started in
    assert "--server.headless" not in cmd
    # Streamlit's magic off, as in the tests' AppTests (app.server.settings.STREAMLIT_OPTIONS)
    assert _option(cmd, "--runner.magicEnabled") == "false"
    import streamlit

    assert streamlit.config.get_option("runner.magicEnabled") is False
    # no gc.collect(2) after every script run: 0.20-0.28 s of every page switch (benchmarks/bench_pages.py --against)
    assert _option(cmd, "--runner.postScriptGC") == "false"


def test_tracebacks_reach_the_browser_only_with_debug():
    cmd, _ = app_command(app_parser().parse_args([]), {})
    assert _option(cmd, "--client.showErrorDetails") == "none"  # users see the pages' messages, no server paths
    cmd, _ = app_command(app_parser().parse_args(["--debug"]), {})
    assert _option(cmd, "--client.showErrorDetails") == "full"


def test_host_home_roots_and_upload_limit_are_passed_on(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    args = app_parser().parse_args(
        ["--host", "0.0.0.0", "--home", str(tmp_path / "h"), "--root", str(a), "--root", str(b),
         "--max-upload-mb", "300", "--port", "9000", "--headless", str(tmp_path / "run")]
    )  # fmt: skip
    cmd, env = app_command(args, {HOME_ENV: "/elsewhere"})
    assert _option(cmd, "--server.address") == "0.0.0.0"
    assert _option(cmd, "--server.maxUploadSize") == "300" and max_upload_mb(env) == 300
    assert _option(cmd, "--server.headless") == "true"
    assert env[HOME_ENV] == str((tmp_path / "h").resolve())  # --home wins over the environment
    assert env["K3LAB_RUNS"] == str((tmp_path / "run").resolve())
    assert configured_roots(env=env) == [(tmp_path / "h").resolve(), a.resolve(), b.resolve()]


def test_home_from_the_environment_when_not_given(tmp_path):
    _, env = app_command(app_parser().parse_args([]), {HOME_ENV: str(tmp_path / "lib")})
    assert Path(env[HOME_ENV]) == (tmp_path / "lib").resolve()


def test_bad_root_and_limit_are_refused(tmp_path, capsys):
    assert cmd_app(["--root", str(tmp_path / "missing")]) == 2
    assert "--root" in capsys.readouterr().err
    assert cmd_app(["--max-upload-mb", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
