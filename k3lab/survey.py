"""``k3lab survey RUN (--text FILE ... | --sample NAME) [--tokens N] --out DIR``: statistics of a run over every token
of a corpus (``analysis.survey.engine``), kept as bounded aggregates in a survey folder that opens without the weights.

    k3lab survey sample_checkpoints/k3-full --sample shakespeare --tokens 200000 --out surveys/k3-full
    torchrun --nproc-per-node 3 -m k3lab survey RUN --sample shakespeare --tokens 2000000 --out DIR

Run the same command on the same DIR again to continue an interrupted survey (Ctrl-C saves what is done).
Exit codes: 0 written (or already complete), 2 bad input, 130 interrupted (DIR holds the batches done).
"""

from __future__ import annotations

import argparse
import os
import sys

from k3core.utils import input_limits as limits
from k3lab.options import Parser, arg_int

MAX_SURVEY_TOKENS = 10**12  # --tokens: a corpus is read in batches, never whole


def build_parser() -> argparse.ArgumentParser:
    from analysis.survey.plan import SURVEY_SAMPLES

    p = Parser(
        prog="k3lab survey",
        description="Survey a checkpoint over a corpus: per MoE layer and expert the load (with a Wilson interval), "
        "gate mass, MaxVio and CV, co-activation, selection margins, quantile-balancing cut-off gaps, unchosen scores, "
        "REAP saliency, an expert atlas (top contexts by routing weight, a reservoir of contexts, lift over the "
        "corpus's token classes, a specialisation score), reuse distances and expert-cache hit rates (LRU, LFU, "
        "Belady; per layer and shared, in experts and bytes); KDA decay and beta per head; MLA entropy and sink mass "
        "per head; AttnRes depth weights per site; loss by position. Only bounded aggregates are kept. The folder "
        "DIR (survey.json + state.npz) is saved every few batches and continues where it stopped when the same "
        "command is run again; `k3lab app` and `k3lab survey --report DIR` open it without the checkpoint.",
        epilog="Cost: the command prints the plan and an estimate from the first batch before the rest runs.",
    )
    p.add_argument("run", metavar="RUN", nargs="?", help="checkpoint folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", action="append", help="UTF-8 text file (repeat: concatenated)")
    src.add_argument(
        "--sample",
        metavar="NAME",
        choices=tuple(SURVEY_SAMPLES),
        help="built-in corpus: " + "; ".join(f"{k}: {v}" for k, v in SURVEY_SAMPLES.items()),
    )
    p.add_argument(
        "--tokens",
        type=arg_int(1, MAX_SURVEY_TOKENS),
        default=None,
        metavar="N",
        help="survey the first N tokens (default: all)",
    )
    p.add_argument("--out", metavar="DIR", help="survey folder to write, or to continue")
    p.add_argument(
        "--seq-len",
        type=arg_int(2, limits.MAX_TOKENS),
        default=None,
        help="tokens per sequence (default: the run's training length, else 256)",
    )
    p.add_argument("--batch-size", type=arg_int(1, 4096), default=8, help="sequences per forward (default 8)")
    p.add_argument(
        "--top-contexts", type=arg_int(1, 1024), default=16, help="top contexts kept per expert (default 16)"
    )
    p.add_argument(
        "--reservoir", type=arg_int(1, 1024), default=16, help="random contexts kept per expert (default 16)"
    )
    p.add_argument(
        "--seed", type=arg_int(0, limits.MAX_SEED), default=0, help="seed of the context reservoir (default 0)"
    )
    p.add_argument(
        "--save-every", type=arg_int(1, 1_000_000), default=16, help="save the folder every N batches (default 16)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report", metavar="DIR", help="print the summary of a survey folder (no checkpoint needed)")
    p.add_argument("--export", metavar="DIR", help="with --report: write every statistic as CSV and JSON into DIR")
    p.add_argument("--device", default="cpu", help="cpu (default) or a GPU such as cuda")
    p.add_argument(
        "--threads",
        type=arg_int(1, limits.MAX_THREADS),
        default=None,
        help="torch threads (default: chosen for the model's size)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        return _report(args)
    if not args.run or not args.out or not (args.text or args.sample):
        print("k3lab survey: give RUN, --text FILE or --sample NAME, and --out DIR (or --report DIR)", file=sys.stderr)
        return 2
    from contextlib import nullcontext

    from analysis.survey.folder import check_survey_folder, survey_lock
    from analysis.survey.plan import SurveyError

    try:  # before the model loads: a folder of the user's files, or one another survey is writing, is refused
        check_survey_folder(args.out)
        with survey_lock(args.out) if int(os.environ.get("RANK", "0")) == 0 else nullcontext():
            return _survey(args)
    except SurveyError as exc:
        print(f"k3lab survey: {exc}", file=sys.stderr)
        return 2


def _survey(args: argparse.Namespace) -> int:
    """``main`` once --out is this process's to write (rank 0 holds the folder's lock)."""
    import torch

    from analysis.runs.loading import load_run
    from analysis.runs.texts import text_tokenizer
    from analysis.survey import engine as sv
    from analysis.survey.plan import SurveyError, corpus_ids, make_plan, sample_corpus_text
    from k3core.loading.tensor_info import CheckpointError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        run = load_run(args.run, device=args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        tokenizer = text_tokenizer(run.config, run.tokenizer)
        if args.text:
            parts = []
            for name in args.text:
                with open(name, encoding="utf-8") as fh:
                    parts.append(fh.read())
            text, corpus = "\n".join(parts), " + ".join(os.path.basename(n) for n in args.text)
        else:
            text, corpus = sample_corpus_text(args.sample), args.sample
        if args.tokens is not None and args.tokens < 2:
            raise ValueError("--tokens must be at least 2")
        ids = corpus_ids(text, tokenizer, args.tokens)
        seq_len = args.seq_len or sv.default_seq_len(run)
        plan = make_plan(
            ids,
            corpus,
            run.fingerprint,
            seq_len,
            args.batch_size,
            top_contexts=args.top_contexts,
            reservoir=args.reservoir,
            seed=args.seed,
        )
    except (CheckpointError, SurveyError, ValueError, OSError, UnicodeDecodeError) as exc:
        print(f"k3lab survey: {exc}", file=sys.stderr)
        return 2
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        try:
            merged = sv.run_survey_distributed(run, ids, plan, args.out)
        finally:
            dist.destroy_process_group()
        if merged is not None:
            print(f"k3lab survey: wrote {args.out} ({plan.tokens:,} tokens, {world} processes)")
        return 0
    print(
        f"k3lab survey: {run.label} on {corpus}: {plan.sequences:,} sequences x {seq_len} = {plan.tokens:,} tokens "
        f"in {plan.batches:,} batches of {plan.batch_size}"
    )
    try:
        estimate = sv.estimate_seconds(run, ids, plan)
        speed = plan.tokens / max(estimate, 1e-9)
        print(f"k3lab survey: estimated {estimate:,.0f} s on this machine ({speed:,.0f} tokens/s)")
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.batches, unit="batch", desc="survey")

        def progress(done: int, total: int) -> bool:
            if bar is not None:
                bar.n = done
                bar.refresh()
            return True

        sv.run_survey(run, ids, plan, args.out, progress=progress, save_every=args.save_every)
        if bar is not None:
            bar.close()
    except KeyboardInterrupt:
        print(
            f"\nk3lab survey: interrupted; {args.out} holds the batches saved so far: run again to continue",
            file=sys.stderr,
        )
        return 130
    except (SurveyError, OSError) as exc:
        print(f"k3lab survey: {exc}", file=sys.stderr)
        return 2
    print(f"k3lab survey: wrote {args.out}")
    return 0


def _report(args) -> int:
    from analysis.survey.folder import read_survey
    from analysis.survey.plan import SurveyError
    from analysis.survey.tables import export_tables, summary_text

    try:
        survey = read_survey(args.report)
        print(summary_text(survey))
        if args.export:
            written = export_tables(survey, args.export)
            print(f"k3lab survey: wrote {len(written)} files into {args.export}")
    except (SurveyError, OSError) as exc:
        print(f"k3lab survey: {exc}", file=sys.stderr)
        return 2
    return 0
