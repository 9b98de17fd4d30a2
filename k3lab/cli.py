"""The ``k3lab`` command: one entry point wiring the same functions the app uses.

k3lab app [RUN ...]        open the Streamlit app (default: the shipped sample checkpoints)
k3lab train ...            train a config (see k3lab train --help)
k3lab report RUN [RUN2]    headless HTML report with every figure and its data
k3lab inspect RUN          config, parameter counts, layer map, headline numbers
k3lab weights PATH --out DIR   weight-only diagnostics of a checkpoint of any size (no model built)
k3lab generate RUN         sample text from a checkpoint
k3lab presets              list the named configurations and their sizes
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from analysis.cli_options import add_device_options

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES = REPO_ROOT / "sample_checkpoints"

COMMANDS = {
    "app": "open the Streamlit app",
    "train": "train a K3 config (byte-level, Shakespeare by default)",
    "report": "write a headless HTML report for one or two runs",
    "inspect": "print config, parameter counts, layer map and headline numbers",
    "weights": "weight-only diagnostics (decay, depth, routing) of a checkpoint of any size",
    "generate": "generate text from a checkpoint",
    "presets": "list the named configurations",
}


def _usage() -> str:
    lines = ["usage: k3lab COMMAND [options]", "", "commands:"]
    lines += [f"  {name:10s} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Run `k3lab COMMAND --help` for the options of a command."]
    return "\n".join(lines)


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
    from app.settings import HOME_ENV, MAX_UPLOAD_ENV, ROOTS_ENV, home_dir

    env = dict(os.environ if environ is None else environ)
    if args.runs:
        env["K3LAB_RUNS"] = os.pathsep.join(str(Path(r).resolve()) for r in args.runs)
    env[HOME_ENV] = str((Path(args.home).expanduser() if args.home else home_dir(env)).resolve())
    env[ROOTS_ENV] = os.pathsep.join(str(Path(r).expanduser().resolve()) for r in (args.root or [os.getcwd()]))
    env[MAX_UPLOAD_ENV] = str(args.max_upload_mb)
    # app.serve = `streamlit run app/main.py` with the app's libraries imported before the server listens.
    cmd = [sys.executable, "-m", "app.serve",
           "--server.address", args.host,
           "--server.port", str(args.port),
           "--server.maxUploadSize", str(args.max_upload_mb),
           "--browser.gatherUsageStats", "false",
           "--client.toolbarMode", "viewer"]  # fmt: skip
    if args.headless:
        cmd += ["--server.headless", "true"]
    return cmd, env


def app_parser() -> argparse.ArgumentParser:
    from app.settings import DEFAULT_HOST, DEFAULT_MAX_UPLOAD_MB

    parser = argparse.ArgumentParser(
        prog="k3lab app", description=APP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="*", help="checkpoint folders to preload (default: sample_checkpoints/*)")
    parser.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
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
        type=int,
        default=DEFAULT_MAX_UPLOAD_MB,
        metavar="N",
        help=f"largest file the upload form accepts, in MB (default {DEFAULT_MAX_UPLOAD_MB}); bigger checkpoints "
        f"are opened by path",
    )
    parser.add_argument("--headless", action="store_true", help="do not try to open a browser")
    return parser


def cmd_app(argv: list[str]) -> int:
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
    if args.max_upload_mb < 1:
        print("k3lab app: --max-upload-mb must be at least 1", file=sys.stderr)
        return 2
    cmd, env = app_command(args)
    shown = "localhost" if args.host in ("127.0.0.1", "localhost") else args.host
    print(f"k3lab app: serving on http://{shown}:{args.port}")
    print(
        f"k3lab app: runs library in {env['K3LAB_HOME']}; folders that may be opened by path: "
        f"{', '.join([env['K3LAB_HOME'], *env['K3LAB_ROOTS'].split(os.pathsep)])}"
    )
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 0


def load_model_for_cli(args: argparse.Namespace, prog: str):
    """K3ForCausalLM.from_pretrained(args.run) with the device options and a tqdm progress bar on stderr;
    with --device auto the placement plan (bytes per device, layers) is printed before loading."""
    import torch

    from k3core.model import K3ForCausalLM

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if getattr(args, "max_memory", None):
        from k3core.streamed import load_streamed, plan_for_path

        device = "cpu" if args.device == "auto" else args.device
        plan = plan_for_path(args.run, K3ForCausalLM, device=device, dtype=dtype, max_memory=args.max_memory)
        print(f"{prog}: streaming plan\n" + "\n".join("  " + line for line in plan.describe().splitlines()),
              file=sys.stderr)  # fmt: skip
        return load_streamed(args.run, K3ForCausalLM, device=device, dtype=dtype, max_memory=args.max_memory, plan=plan)
    if args.device == "auto":
        plan = K3ForCausalLM.plan_placement(args.run, device="auto", dtype=dtype)
        print(
            f"{prog}: placement plan\n" + "\n".join("  " + line for line in plan.describe().splitlines()),
            file=sys.stderr,
        )
    return K3ForCausalLM.from_pretrained(
        args.run, device=args.device, dtype=dtype, progress=True, offload_folder=args.offload_folder
    )


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="k3lab generate",
        description="Generate text from a checkpoint, tokenised with the checkpoint's own tokenizer: the folder's "
        "tokenizer.json, or Kimi's tiktoken.model + tokenizer_config.json, or UTF-8 bytes for a vocab-256 model.",
    )
    parser.add_argument("run", help="checkpoint folder (config.json + model.safetensors [+ tokenizer files])")
    parser.add_argument("--prompt", default="ROMEO:\n", help="prompt text (default: 'ROMEO:\\n')")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_device_options(parser, offload_folder=True)
    args = parser.parse_args(argv)

    from k3core.checkpoint import CheckpointError
    from k3core.generate import generate_text
    from k3core.runtime import configure_threads
    from k3core.tokenizer import TokenizerError, load_tokenizer

    try:
        model = load_model_for_cli(args, "k3lab generate")
    except (CheckpointError, ValueError) as exc:
        print(f"k3lab generate: {exc}", file=sys.stderr)
        return 2
    configure_threads(model)
    try:
        tokenizer = load_tokenizer(args.run, model.config.vocab_size)
    except TokenizerError as exc:
        print(f"k3lab generate: {exc}", file=sys.stderr)
        return 2
    if args.temperature < 0 or args.tokens < 0:
        print("k3lab generate: --temperature and --tokens must be >= 0", file=sys.stderr)
        return 2
    try:
        text = generate_text(model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, tokenizer)
    except ValueError as exc:  # e.g. a sampled id the tokenizer has no text for (a model vocab padded beyond it)
        print(f"k3lab generate: {exc}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0


WEIGHTS_HELP = """\
Weight-only diagnostics: what a checkpoint learned, read from its small tensors without building
the model, so a 5 TB checkpoint (Kimi K3) answers in seconds on a laptop.

Reads the safetensors headers (parameter layout by depth and kind comes from the shapes), then only
the small tensors, one at a time: KDA A_log / dt_bias (resting decay g0 and its half-life
ln2/(-g0) tokens per channel), AttnRes pseudo-queries (norm per site), scale/bias residuals, router
selection biases and router weights (per layer x expert), and the norm weights. With --experts it
also streams every routed expert matrix for per-expert weight norms (most of the checkpoint; the
byte count is printed first).

Writes into DIR: weights.json (a stable format for scripts), index.html (every figure on one
offline page), and figures/<view>.{html,csv,png,svg} (PNG/SVG need Chromium; without it they are
skipped with a message). Exit codes: 0 done, 1 some figure failed, 2 bad checkpoint.
"""


def cmd_weights(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="k3lab weights", description=WEIGHTS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint folder (config.json + model.safetensors, or shards + index; the Kimi K3 "
        "repo's language_model. prefix and vision tensors are handled) or one .safetensors file",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created if needed)")
    parser.add_argument(
        "--experts",
        action="store_true",
        help="also read every routed expert matrix for per-expert weight norms (reads most of the checkpoint)",
    )
    parser.add_argument("--no-static", action="store_true", help="skip PNG/SVG (no browser start; fastest)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import time

    from tqdm import tqdm

    from analysis import weights as wt
    from k3core.checkpoint_files import CheckpointError

    started = time.perf_counter()
    try:
        source = wt.open_source(args.path)
    except CheckpointError as exc:
        print(f"k3lab weights: {exc}", file=sys.stderr)
        return 2
    print(
        f"k3lab weights: {len(source.tensors):,} tensors, {wt.human_bytes(source.bytes_total)} declared"
        + (f", {len(source.skipped)} skipped (not the text model)" if source.skipped else "")
    )
    if args.experts:
        n = wt.expert_bytes(source)
        print(f"k3lab weights: --experts will read {n:,} bytes ({wt.human_bytes(n)}) of expert matrices")
    bar = tqdm(
        total=0,
        desc="reading",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=args.quiet,
        file=sys.stderr,
        leave=False,
    )

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    label = Path(args.path).resolve().name
    try:
        summary = wt.summarize_source(
            source, experts=args.experts, progress=progress, label=label, path=args.path, started=started
        )
    except CheckpointError as exc:
        bar.close()
        print(f"k3lab weights: {exc}", file=sys.stderr)
        return 2
    bar.close()
    result = wt.write_outputs(summary, args.out, static=not args.no_static)
    share = 100 * summary.bytes_read / max(summary.bytes_total, 1)
    print(
        f"k3lab weights: read {wt.human_bytes(summary.bytes_read)} ({share:.4f}% of declared) in "
        f"{summary.seconds:.2f} s; {summary.total_params:,} parameters in {summary.num_layers} layers"
    )
    for note in summary.notes:
        print(f"k3lab weights: note: {note}")
    static_msgs = {
        m
        for files in result["figures"].values()
        for f, m in files.items()
        if f in ("png", "svg") and not isinstance(m, Path)
    }
    for message in sorted(static_msgs)[:1]:
        print(f"k3lab weights: PNG/SVG not written: {message}", file=sys.stderr)
    for key, message in result["errors"].items():
        print(f"k3lab weights: figure {key} failed: {message}", file=sys.stderr)
    print(f"k3lab weights: wrote {result['json']} and {result['index']}")
    return 1 if result["errors"] else 0


def cmd_presets(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="k3lab presets", description="List the named configurations.").parse_args(argv)
    from analysis.format import format_count
    from k3core.model import K3ForCausalLM
    from k3core.presets import PRESETS

    print(f"{'preset':18s} {'layers':>6s} {'width':>6s} {'total':>12s} {'active':>12s}  layout")
    for name in PRESETS:
        model = K3ForCausalLM.from_config(name, device="meta")
        cfg = model.config
        layout = "".join("M" if t == "MLA" else "k" for t in cfg.layer_types())
        if len(layout) > 40:
            layout = layout[:37] + "..."
        total, active = format_count(model.num_parameters()), format_count(model.num_parameters(active=True))
        print(f"{name:18s} {cfg.num_hidden_layers:6d} {cfg.hidden_size:6d} {total:>12s} {active:>12s}  {layout}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "app":
        return cmd_app(rest)
    if command == "generate":
        return cmd_generate(rest)
    if command == "presets":
        return cmd_presets(rest)
    if command == "train":
        from k3core.training import main as train_main

        return train_main(rest)
    if command == "report":
        from analysis.report import main as report_main

        return report_main(rest)
    if command == "weights":
        return cmd_weights(rest)
    if command == "inspect":
        from analysis.inspect import main as inspect_main

        return inspect_main(rest)
    print(f"k3lab: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
