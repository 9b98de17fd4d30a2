"""``k3lab generate RUN``: sample text from a checkpoint, loaded through ``analysis.runs.loading.load_run`` (the one
loader of report, inspect, weights and the app) and read with the checkpoint's own tokenizer."""

from __future__ import annotations

import sys

from k3core.utils import input_limits as limits
from k3lab.options import Parser, add_device_options, arg_float, arg_int


def print_placement_plan(run: str, device: str, dtype: str | None, prog: str, max_memory: str | None = None) -> None:
    """With ``--max-memory``, the streaming plan (what stays, what streams, bytes and expected time per prompt);
    with ``--device auto``, the placement plan (bytes and layers per device); on stderr before loading."""
    from analysis.runs.loading import DTYPES, dtype_name
    from k3core.modeling.model import K3ForCausalLM

    if max_memory:
        from k3core.interp.trace_size import trace_estimate
        from k3core.loading.streamed_run import plan_for_path

        device = "cpu" if device == "auto" else device
        dtype = DTYPES[dtype_name(dtype)]
        plan = plan_for_path(run, K3ForCausalLM, device=device, dtype=dtype, max_memory=max_memory,
                             trace_estimate=trace_estimate)  # fmt: skip
        print(f"{prog}: streaming plan\n" + "\n".join("  " + line for line in plan.describe().splitlines()),
              file=sys.stderr)  # fmt: skip
        return
    if device != "auto":
        return

    plan = K3ForCausalLM.plan_placement(run, device="auto", dtype=DTYPES[dtype_name(dtype)])
    print(
        f"{prog}: placement plan\n" + "\n".join("  " + line for line in plan.describe().splitlines()), file=sys.stderr
    )


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="k3lab generate",
        description="Generate text from a checkpoint, tokenised with the checkpoint's own tokenizer: the folder's "
        "tokenizer.json, or Kimi's tiktoken.model + tokenizer_config.json, or UTF-8 bytes for a vocab-256 model.",
    )
    parser.add_argument("run", help="checkpoint folder (config.json + model.safetensors [+ tokenizer files])")
    parser.add_argument(
        "--prompt",
        default="ROMEO:\n",
        help=f"prompt text (default: 'ROMEO:\\n'; at most {limits.MAX_PROMPT_TOKENS:,} tokens, the app's cap too)",
    )
    parser.add_argument(
        "--tokens",
        type=arg_int(0, limits.MAX_TOKENS),
        default=200,
        help=f"new tokens to generate (default 200, at most {limits.MAX_TOKENS:,})",
    )
    parser.add_argument("--temperature", type=arg_float(0, 1e6), default=0.8, help="0 for greedy (default 0.8)")
    parser.add_argument(
        "--top-k", type=arg_int(1, limits.MAX_INDEX), default=None, help="sample from the k most likely tokens"
    )
    parser.add_argument("--seed", type=arg_int(0, limits.MAX_SEED), default=0, help="sampling seed (default 0)")
    add_device_options(parser, offload_folder=True)
    args = parser.parse_args(argv)
    try:
        limits.text(args.prompt, "--prompt")
    except limits.InputLimitError as exc:
        print(f"k3lab generate: {exc}", file=sys.stderr)
        return 2

    from analysis.runs.loading import load_run, run_tokenizer
    from k3core.generation.decode import generate_text, prompt_ids
    from k3core.loading.pretrained import load_config
    from k3core.loading.tensor_info import CheckpointError

    try:  # the prompt's cap first, from the folder's config and tokenizer: no model loaded for a refused prompt
        tokenizer, _ = run_tokenizer(args.run, load_config(args.run).vocab_size)
        if tokenizer is not None:
            prompt_ids(args.prompt, tokenizer)
        print_placement_plan(args.run, args.device, args.dtype, "k3lab generate", args.max_memory)
        run = load_run(
            args.run,
            args.device,
            args.dtype,
            progress=True,
            offload_folder=args.offload_folder,
            max_memory=args.max_memory,
        )
    except (CheckpointError, ValueError) as exc:
        print(f"k3lab generate: {exc}", file=sys.stderr)
        return 2
    if run.tokenizer is None:
        print(f"k3lab generate: {run_tokenizer(run.path, run.config.vocab_size)[1]}", file=sys.stderr)
        return 2
    try:
        text = generate_text(
            run.model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, run.tokenizer
        )
    except ValueError as exc:  # e.g. a sampled id the tokenizer has no text for (a model vocab padded beyond it)
        print(f"k3lab generate: {exc}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0
