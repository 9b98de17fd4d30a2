"""``k3lab app``: start the Streamlit app (``app/main.py`` through ``app.server.serve``) with the runs library home,
the folders that may be opened by path and the upload limit in its environment. The server is a child process that
stops with this one: SIGTERM, SIGINT and SIGHUP are passed on to it, it is killed if it outlives them, and (on Linux)
it gets SIGTERM if this process dies without a word (``kill -9``)."""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from k3lab.options import Parser, arg_int

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_UPLOAD_MB = 65_536  # --max-upload-mb: Streamlit holds an upload in memory


APP_HELP = """\
Open the k3lab Streamlit app.

The app listens on 127.0.0.1 (this machine only) unless --host says otherwise. Runs you add (uploads,
folders opened by path, random-init presets) are kept in the runs library under --home (default
$K3LAB_HOME or ~/.k3lab) and are there again after a reload or a restart. Opening a checkpoint by
path reads this server's disk, so only folders under --root (default: the folder the app is started
in) and the library home may be opened; symlinks are resolved before that check.
"""


def app_command(args: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The streamlit command line and environment for parsed ``k3lab app`` arguments."""
    from app.server.settings import HOME_ENV, JOB_MEMORY_ENV, MAX_UPLOAD_ENV, ROOTS_ENV, STREAMLIT_OPTIONS, home_dir

    env = dict(os.environ if environ is None else environ)
    if args.runs:
        env["K3LAB_RUNS"] = os.pathsep.join(str(Path(r).resolve()) for r in args.runs)
    env[HOME_ENV] = str((Path(args.home).expanduser() if args.home else home_dir(env)).resolve())
    env[ROOTS_ENV] = os.pathsep.join(str(Path(r).expanduser().resolve()) for r in (args.root or [os.getcwd()]))
    env[MAX_UPLOAD_ENV] = str(args.max_upload_mb)
    if getattr(args, "job_memory", None):
        env[JOB_MEMORY_ENV] = str(args.job_memory)
    # app.server.serve = `streamlit run app/main.py` with the app's libraries imported before the server listens.
    cmd = [sys.executable, "-m", "app.server.serve",
           "--server.address", args.host,
           "--server.port", str(args.port),
           "--server.maxUploadSize", str(args.max_upload_mb),
           "--browser.gatherUsageStats", "false",
           "--client.toolbarMode", "viewer",
           # Tracebacks (with server paths) reach the browser only with --debug; users get the page's message.
           "--client.showErrorDetails", "full" if args.debug else "none"]  # fmt: skip
    cmd += [arg for key, value in STREAMLIT_OPTIONS.items() for arg in (f"--{key}", str(value).lower())]
    if args.headless:
        cmd += ["--server.headless", "true"]
    return cmd, env


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_WAIT_S = 10.0  # how long the server may take to stop after SIGTERM before it is killed
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


def host_warning(host: str) -> str | None:
    """The warning for a listen address other than this machine's loopback (None for 127.0.0.1, ::1, localhost)."""
    name = host.strip().strip("[]")
    try:
        if ipaddress.ip_address(name).is_loopback:
            return None
    except ValueError:
        if name.lower() == "localhost":
            return None
    where = "every interface of this machine" if name in ("0.0.0.0", "::", "") else f"{host} (not this machine only)"
    return (
        f"k3lab app: warning: --host {host} serves {where}: anyone who reaches the port can use the app, start jobs "
        "and open by path the folders under --root on this server's disk. Use --host 127.0.0.1 (the default) unless "
        "the network is yours."
    )


class _StopRequested(Exception):
    """Raised by serve()'s signal handler to end its unbounded wait for the server."""


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the parent dies, even of SIGKILL (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def serve(cmd: list[str], env: dict[str, str]) -> int:
    """Run the server command as a child that stops with this process: the signals in FORWARDED_SIGNALS are passed on
    to it; a child that outlives the first of them by STOP_WAIT_S is killed (and the exit status is still that
    signal's); when this process leaves for any other reason a child still running gets SIGTERM, then SIGKILL after
    STOP_WAIT_S. Returns the child's exit status (128 + N for a child ended by signal N)."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    stop: list[int] = []  # the first stop signal received

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)
        if not stop:  # leave the unbounded wait below for one of STOP_WAIT_S
            stop.append(signum)
            raise _StopRequested

    previous: dict[int, Any] = {}
    try:
        try:
            for sig in FORWARDED_SIGNALS:
                previous[sig] = signal.signal(sig, forward)
            code = proc.wait()
        except _StopRequested:
            try:
                code = proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:  # a server slow to stop (a loaded machine) is not waited on forever
                proc.kill()
                proc.wait()
                code = -stop[0]  # ended by the signal it was sent; the kill only finished it
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 128 - code if code < 0 else code


def _job_memory(value: str) -> str:
    from k3core.utils.units import parse_bytes

    try:
        parse_bytes(value, what="--job-memory")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def app_parser() -> argparse.ArgumentParser:
    from app.server.settings import DEFAULT_HOST, DEFAULT_MAX_UPLOAD_MB

    parser = Parser(prog="k3lab app", description=APP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="checkpoint folders to preload (default: sample_checkpoints/*)")
    parser.add_argument("--port", type=arg_int(1, 65_535), default=8501, help="port to serve on (default 8501)")
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0 serves every interface, "
        f"so anyone who reaches the port can open the folders under --root)",
    )
    parser.add_argument("--home", metavar="DIR", help="runs library folder (default $K3LAB_HOME or ~/.k3lab)")
    parser.add_argument(
        "--root",
        action="append",
        metavar="DIR",
        help="a folder whose checkpoints may be opened by path (repeatable; default: the current folder; the "
        "library home is always allowed)",
    )
    parser.add_argument(
        "--max-upload-mb",
        type=arg_int(1, MAX_UPLOAD_MB),
        default=DEFAULT_MAX_UPLOAD_MB,
        metavar="N",
        help=f"largest file the upload form accepts, in MB (default {DEFAULT_MAX_UPLOAD_MB}); bigger checkpoints "
        f"are opened by path",
    )
    parser.add_argument(
        "--job-memory",
        type=_job_memory,
        metavar="SIZE",
        help="memory for the server's long jobs (trace, experiment, patching, attribution), e.g. 6GB (default: half "
        "of this machine's memory): three quarters run jobs at once (one that does not fit waits, one over it is "
        "refused), a quarter keeps their results for the next visit (oldest dropped first); loaded models are "
        "outside it",
    )
    parser.add_argument("--headless", action="store_true", help="do not try to open a browser")
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks in the browser (off: users see messages only)"
    )
    return parser


def main(argv: list[str]) -> int:
    args = app_parser().parse_args(argv)
    main_py = REPO_ROOT / "app" / "main.py"
    if not main_py.is_file():
        print(f"k3lab app: cannot find the app at {main_py}", file=sys.stderr)
        return 2
    for run in args.runs:
        if not Path(run).is_dir():
            print(f"k3lab app: {run} is not a checkpoint folder", file=sys.stderr)
            return 2
    for root in args.root or []:
        if not Path(root).expanduser().is_dir():
            print(f"k3lab app: --root {root} is not a folder", file=sys.stderr)
            return 2
    from app.library.run_folders import LibraryError
    from app.library.store import check_library_home
    from app.server.settings import home_dir

    try:
        check_library_home(Path(args.home).expanduser() if args.home else home_dir())
    except LibraryError as exc:
        print(f"k3lab app: {exc}", file=sys.stderr)
        return 2
    cmd, env = app_command(args)
    shown = "localhost" if args.host in ("127.0.0.1", "localhost") else args.host
    warning = host_warning(args.host)
    if warning:
        print(warning, file=sys.stderr)
    print(f"k3lab app: serving on http://{shown}:{args.port}")
    print(
        f"k3lab app: runs library in {env['K3LAB_HOME']}; folders that may be opened by path: "
        f"{', '.join([env['K3LAB_HOME'], *env['K3LAB_ROOTS'].split(os.pathsep)])}"
    )
    return serve(cmd, env)
