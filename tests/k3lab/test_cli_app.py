"""`k3lab app`: the streamlit command it builds (listen address, upload limit), the settings it passes on, the warning
for a listen address beyond this machine, and its server stopping with it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.server.settings import HOME_ENV, MAX_UPLOAD_ENV, ROOTS_ENV, configured_roots, max_upload_mb
from benchmarks.bench_app import free_port, wait_healthy
from k3lab import app as app_module
from k3lab.app import app_command, app_parser, host_warning
from k3lab.app import main as cmd_app

REPO = Path(__file__).resolve().parents[2]


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
    with pytest.raises(SystemExit, match="2"):
        cmd_app(["--max-upload-mb", "0"])
    assert "--max-upload-mb: must be in 1..65,536, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- the server process
def test_a_non_loopback_host_is_warned_about_at_start(tmp_path, monkeypatch, capsys):
    assert host_warning("127.0.0.1") is None and host_warning("localhost") is None and host_warning("::1") is None
    assert "every interface" in host_warning("0.0.0.0") and "every interface" in host_warning("::")
    assert "not this machine only" in host_warning("192.168.1.20")
    served = []
    monkeypatch.setattr(app_module, "serve", lambda cmd, env: served.append(cmd) or 0)
    assert cmd_app(["--host", "0.0.0.0", "--root", str(tmp_path), "--home", str(tmp_path / "h"), "--headless"]) == 0
    err = capsys.readouterr().err
    assert served and "warning: --host 0.0.0.0 serves every interface" in err and "server's disk" in err
    assert cmd_app(["--root", str(tmp_path), "--home", str(tmp_path / "h"), "--headless"]) == 0
    assert "warning" not in capsys.readouterr().err


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)  # a poll interval: the condition is the server's state


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_k3lab_app_stops_its_server(tmp_path, sig):
    """`k3lab app` on a free port, waited for until it serves; a signal to `k3lab app` alone (not its group): the
    port closes and neither process is left, the Streamlit child included (it was left serving, issue 36)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / ".config"),
               STREAMLIT_SERVER_FILE_WATCHER_TYPE="none")  # fmt: skip
    cmd = [sys.executable, "-m", "k3lab.cli", "app", "--headless", "--port", str(port), "--home",
           str(tmp_path / "home"), "--root", str(tmp_path)]  # fmt: skip
    log = open(tmp_path / "app.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    children = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc, tmp_path / "app.log", 180)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "k3lab app runs its server as a child"
        proc.send_signal(sig)
        assert proc.wait(timeout=60) in (0, 128 + sig)
        _wait_for(lambda: not _port_open(port), 30, f"port {port} still open")
        for child in children:
            _wait_for(lambda c=child: not psutil.pid_exists(c.pid), 30, f"server child {child.pid} left running")
    finally:  # whatever happened, nothing of this test is left running
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        log.close()


_STUBBORN_SERVER = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(600)
"""

_LAUNCHER = """
import sys
from k3lab import app
app.STOP_WAIT_S = 1.0
sys.exit(app.serve([sys.executable, "-c", sys.argv[1], sys.argv[2]], {}))
"""


def test_a_server_that_ignores_the_stop_signal_is_killed_after_the_stop_wait(tmp_path):
    """serve() forwards SIGTERM, then kills a child still running STOP_WAIT_S later (a loaded machine's Streamlit
    can take minutes to stop) and exits with the signal's status: the launcher never waits on its server forever."""
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _STUBBORN_SERVER, str(ready)], env=env)
    children = []
    try:
        _wait_for(ready.exists, 60, "the server child never started")
        children = psutil.Process(proc.pid).children()
        assert len(children) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        _wait_for(lambda: not psutil.pid_exists(children[0].pid), 10, "the stubborn child was left running")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
