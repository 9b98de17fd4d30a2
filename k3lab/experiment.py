"""``k3lab experiment``, ``k3lab patch`` and ``k3lab attribute``: edits, activation patching and attribution
from the command line, written as JSON + figures (HTML, CSV, JSON, PNG/SVG where Chromium exists).
``k3lab patch`` and ``k3lab attribute`` are ``patch_main`` and ``attribute_main`` (k3lab/patch.py, attribute.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from k3core.utils import input_limits as limits
from k3lab.options import Parser, add_device_options, arg_int, arg_position

#: analysis.experiments.attribution.METHODS, spelled here so that --help does not import torch (a test keeps them equal)
METHOD_CHOICES = ("feature_ablation", "shapley", "integrated_gradients", "ig_frozen_routing")

EXPERIMENT_HELP = """\
Run a text through a checkpoint twice, as it is and with edits, and write what changed per token.

Edits (repeat --edit) are JSON objects or the short form KIND.OP key=value ...:
  value.zero point=mixer_out layers=2          zero layer 2's attention output (also: scale/replace/add value=...)
  value.scale point=kda.g layers=1 value=2 heads=0 tokens=4:9
  attnres.uniform site=3.attn                  depth weights of a site uniform (one_hot / mask sources=...)
  attnres.mask site=output sources=embedding   a source masked, the rest renormalised
  kda.pin_g layer=1 value=0                    KDA: pin_g, scale_g, scale_beta value=..., reset_state tokens=P, gate_off
  moe.ban layer=2 experts=1,5                  MoE: ban, force (experts=...), uniform, bias_off, shared_off
  mla.mask_keys layer=3 keys=0:1               MLA: mask a key range (e.g. the sink at position 0)
Hook point names: k3core.interp.catalogue.hook_points(config) lists them (see the README, Python API).

Writes DIR/experiment.json (edits, summary, per-token effects, top-5 prediction changes at --positions)
and DIR/figures/loss_change.* (+ lens_base.*, lens_edited.* with --lens).
"""

PATCH_HELP = """\
Activation patching: run a clean and a corrupted text (same number of tokens), then the corrupted one
again with each (layer, site) activation taken from the clean run, and report the fraction of the metric
restored: (m(patched) - m(corrupted)) / (m(clean) - m(corrupted)).

Metric: --metric logit_diff --correct A --wrong B  (logit of A minus logit of B at --position, default last;
A and B are texts of one token each, or #ID), or --metric span_loss --span START:STOP (mean loss of the clean
tokens START..STOP-1). Sites: resid (the depth state entering the layer), mixer_out, ffn_out, depth_weights.
Writes DIR/patching.json and DIR/figures/patching.*.
"""

ATTRIBUTE_HELP = """\
Attribution of a target continuation's log-probabilities to the prompt's tokens with Captum
(feature_ablation, shapley, integrated_gradients; "all" runs the three), per output token x input token,
and with --layers a layer attribution (integrated gradients over every sub-layer output) grouped by mixer
type (KDA / MLA) and FFN kind (dense / routed / shared). The baseline replaces input tokens by
--baseline-token (default 0). Writes DIR/attribution.json and DIR/figures/attribution_*.
"""


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command's parser with the options all three share: RUN, --out, --max-tokens, --no-static, device."""
    parser = Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(parser)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="checkpoint folder (config.json + model.safetensors [+ tokenizer files])")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created if needed)")
    parser.add_argument(
        "--max-tokens",
        type=arg_int(2, limits.MAX_TOKENS),
        default=256,
        help=f"tokens kept from each text (default 256, at most {limits.MAX_TOKENS:,})",
    )
    parser.add_argument("--no-static", action="store_true", help="skip PNG/SVG figures (no browser start)")
    add_device_options(parser)


def experiment_parser() -> argparse.ArgumentParser:
    p = _parser("k3lab experiment", EXPERIMENT_HELP)
    p.add_argument("--edit", action="append", required=True, metavar="EDIT", help="an edit (repeatable), see above")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="input text")
    src.add_argument("--text-file", metavar="FILE", help="read the input text from a file")
    src.add_argument("--sample", help="a built-in input: shakespeare (default), mqar, repeat")
    p.add_argument("--positions", default="", help="positions for top-5 prediction changes, e.g. 3,7 (default: last)")
    p.add_argument("--lens", action="store_true", help="also the AttnRes / logit lens of both runs")
    return p


def patch_parser() -> argparse.ArgumentParser:
    p = _parser("k3lab patch", PATCH_HELP)
    p.add_argument("--clean", required=True, help="clean text")
    p.add_argument("--corrupted", required=True, help="corrupted text (same number of tokens)")
    p.add_argument("--metric", choices=("logit_diff", "span_loss"), default="logit_diff")
    p.add_argument("--correct", help="logit_diff: the correct token (text of one token, or #ID)")
    p.add_argument("--wrong", help="logit_diff: the wrong token (text of one token, or #ID)")
    p.add_argument(
        "--position",
        type=arg_position(),
        default=-1,
        help="logit_diff: position read, 0-based (default -1, the last; no other negative is accepted)",
    )
    p.add_argument("--span", help="span_loss: START:STOP positions whose clean tokens are predicted")
    p.add_argument("--sites", default="resid,mixer_out,ffn_out,depth_weights", help="comma-separated sites")
    p.add_argument("--per-position", action="store_true", help="patch each position separately")
    return p


def attribute_parser() -> argparse.ArgumentParser:
    p = _parser("k3lab attribute", ATTRIBUTE_HELP)
    p.add_argument("--prompt", required=True, help="input text")
    p.add_argument("--target", required=True, help="continuation whose log-probabilities are attributed")
    p.add_argument(
        "--method",
        default="feature_ablation",
        choices=(*METHOD_CHOICES, "all"),
        help="attribution method (default feature_ablation; ig_frozen_routing: integrated gradients with every MoE "
        "layer's experts held at the input's, the one whose attributions add up on an MoE model)",
    )
    p.add_argument(
        "--baseline-token",
        type=arg_int(0, limits.MAX_INDEX),
        default=0,
        help="token id replacing ablated inputs (default 0)",
    )
    p.add_argument(
        "--steps",
        type=arg_int(1, limits.MAX_IG_STEPS),
        default=64,
        help=f"integrated gradients: integration steps (default 64, 1..{limits.MAX_IG_STEPS}; ig_frozen_routing "
        "refines up to 16x where needed)",
    )
    p.add_argument(
        "--samples",
        type=arg_int(1, limits.MAX_SHAPLEY_SAMPLES),
        default=8,
        help=f"shapley: permutations sampled (default 8, 1..{limits.MAX_SHAPLEY_SAMPLES})",
    )
    p.add_argument(
        "--seed",
        type=arg_int(0, limits.MAX_INDEX),
        default=0,
        help="shapley: seed of the sampled permutations (default 0)",
    )
    p.add_argument("--layers", action="store_true", help="also the layer attribution by kind")
    return p


def _load(args: argparse.Namespace, output: str) -> Any:
    """The run of RUN, once --out is known to be a folder this command may write ``output`` (e.g.
    experiment.json) into (``check_output_folder``: before the model loads)."""
    from analysis.runs import loading as runs_mod
    from k3core.utils.files import check_output_folder
    from k3core.utils.runtime import configure_threads

    check_output_folder(args.out, (output,), f"{output.removesuffix('.json')} folder")
    run = runs_mod.load_run(args.run, device=args.device, dtype=args.dtype)
    configure_threads(run.model)
    return run


def _label(run: Any) -> Any:
    from analysis.runs import texts

    try:
        tok = texts.text_tokenizer(run.config, run.tokenizer)
    except ValueError:
        return str
    return lambda i: repr(tok.token_strings([i])[0])[1:-1]


def _write(out: Path, name: str, data: dict, figures: list, static: bool) -> list[str]:
    from analysis.output.export import export_many, failures

    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=1, default=str))
    formats = ("html", "csv", "json", "png", "svg") if static else ("html", "csv", "json")
    problems = failures(export_many(figures, out / "figures", formats)) if figures else {}
    print(f"wrote {path} and {len(figures)} figure(s) in {out / 'figures'}")
    return [f"{k}: {v}" for k, v in problems.items() if not k.endswith((".png", ".svg"))]


def _text_arg(text: str | None, file: str | None, what: str) -> str:
    """The text of --text, or of --text-file read within the limit (``k3core.utils.input_limits``)."""
    if text is not None:
        return limits.text(text, what)
    from k3core.utils.files import read_bytes_limited

    return limits.text(read_bytes_limited(file, limits.MAX_TEXT_BYTES).decode("utf-8", errors="replace"), file)


def _one_token(text: str, run: Any) -> int:
    from analysis.runs import texts

    if text.startswith("#") and text[1:].isdigit():
        return limits.bounded_int(text[1:], f"token {text}", 0, run.config.vocab_size - 1)
    ids = texts.text_tokenizer(run.config, run.tokenizer).encode(text)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens, not one (give #ID for a token id)")
    return ids[0]


def main(argv: list[str]) -> int:
    args = experiment_parser().parse_args(argv)
    from analysis.experiments import effects
    from analysis.figures.experiment import lens_figure, loss_change_figure
    from analysis.metrics import lens
    from analysis.runs import texts
    from k3core.interp.edit_kinds import EditError
    from k3core.interp.interventions import intervene, parse_edit
    from k3core.loading.tensor_info import CheckpointError

    try:
        edits = [parse_edit(e) for e in args.edit]
        run = _load(args, "experiment.json")
        if args.text is not None or args.text_file:
            text = _text_arg(args.text, args.text_file, "--text")
            ids = texts.text_input(text, run.config, args.max_tokens, tokenizer=run.tokenizer).input_ids
        else:
            sample = texts.sample_input(args.sample or "shakespeare", run.config, args.max_tokens, run.tokenizer)
            ids = sample.input_ids
        from k3core.interp.interventions import compile_edits

        compile_edits(run.config, edits)  # names checked before any forward
        listed = [p for p in args.positions.split(",") if p.strip()]
        if len(listed) > limits.MAX_POSITIONS:
            raise ValueError(f"--positions lists {len(listed):,} positions, over the limit of {limits.MAX_POSITIONS}")
        positions = [limits.position(int(p) if p.strip().lstrip("-").isdigit() else p, ids.shape[1], "--positions")
                     for p in listed] or [ids.shape[1] - 2]  # fmt: skip
        exp = effects.run_experiment(run.model, ids, edits)
    except (EditError, CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab experiment: {exc}", file=sys.stderr)
        return 2
    label = _label(run)
    table = exp.effects(ids, label)
    changes = effects.prediction_changes(exp.base_logits, exp.edited_logits, positions, 5, label)
    figures = [(loss_change_figure(table), table, "loss_change")]
    if args.lens:
        labels, base = lens.lens_logits(run.model, ids)
        with intervene(run.model, edits):
            _, edited = lens.lens_logits(run.model, ids)
        for name, logits in (("base", base), ("edited", edited)):
            lt = lens.lens_table(labels, logits, ids, 5, label)
            figures.append((lens_figure(lt), lt.drop(columns=["top_ids"]), f"lens_{name}"))
    summary = exp.summary(ids)
    data = dict(run=str(args.run), tokens=ids.shape[1], **summary, effects=table.to_dict("records"))
    data["prediction_changes"] = changes.to_dict("records")
    problems = _write(Path(args.out), "experiment.json", data, figures, not args.no_static)
    print(
        f"k3lab experiment: mean loss {summary['base_loss']:.4f} -> {summary['edited_loss']:.4f} nats "
        f"({summary['loss_change']:+.4f}); top-1 changed at {summary['positions_changed_top1']} positions"
    )
    for p in problems:
        print(f"k3lab experiment: {p}", file=sys.stderr)
    return 1 if problems else 0


def patch_main(argv: list[str]) -> int:
    args = patch_parser().parse_args(argv)
    from tqdm import tqdm

    from analysis.experiments import patching
    from analysis.figures.experiment import patching_figure
    from analysis.runs import texts
    from k3core.loading.tensor_info import CheckpointError

    try:
        run = _load(args, "patching.json")
        clean_text, corrupted_text = limits.text(args.clean, "--clean"), limits.text(args.corrupted, "--corrupted")
        clean = texts.text_input(clean_text, run.config, args.max_tokens, tokenizer=run.tokenizer).input_ids
        corrupted = texts.text_input(corrupted_text, run.config, args.max_tokens, tokenizer=run.tokenizer).input_ids
        if args.metric == "logit_diff":
            if not (args.correct and args.wrong):
                raise ValueError("--metric logit_diff needs --correct and --wrong")
            position = limits.position(args.position, clean.shape[1], "--position")
            metric = patching.Metric("logit_diff", _one_token(args.correct, run), _one_token(args.wrong, run), position)
        else:
            if not args.span or ":" not in args.span:
                raise ValueError("--metric span_loss needs --span START:STOP")
            start, _, stop = args.span.partition(":")
            start, stop = limits.span(start, stop, clean.shape[1], "--span")
            metric = patching.Metric("span_loss", start=start, stop=stop)
        sites = [s.strip() for s in args.sites.split(",") if s.strip()]
        bar = tqdm(total=0, desc="patching", file=sys.stderr, leave=False, mininterval=0.5)

        def progress(done: int, total: int, what: str) -> None:
            bar.total = total
            bar.set_postfix_str(what)
            bar.update(done - bar.n)

        df = patching.activation_patching(
            run.model, clean, corrupted, metric, sites, per_position=args.per_position, progress=progress
        )
        bar.close()
    except (patching.PatchingError, CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab patch: {exc}", file=sys.stderr)
        return 2
    data = dict(run=str(args.run), metric=metric.to_dict(), **df.attrs, table=df.to_dict("records"))
    problems = _write(
        Path(args.out), "patching.json", data, [(patching_figure(df), df, "patching")], not args.no_static
    )
    print(f"k3lab patch: clean {df.attrs['clean_metric']:.4f}, corrupted {df.attrs['corrupted_metric']:.4f}")
    for p in problems:
        print(f"k3lab patch: {p}", file=sys.stderr)
    return 1 if problems else 0


def attribute_main(argv: list[str]) -> int:
    args = attribute_parser().parse_args(argv)
    import torch

    from analysis.experiments import attribution as attr
    from analysis.experiments.attribution_inputs import AttributionError
    from analysis.experiments.layer_attribution import layer_attribution
    from analysis.figures.experiment import attribution_figure, layer_attribution_figure
    from analysis.runs import texts
    from k3core.loading.tensor_info import CheckpointError

    methods = attr.METHODS if args.method == "all" else (args.method,)
    try:
        run = _load(args, "attribution.json")
        tok = texts.text_tokenizer(run.config, run.tokenizer)
        limits.bounded_int(args.baseline_token, "--baseline-token", 0, run.config.vocab_size - 1)
        x = torch.tensor(tok.encode(limits.text(args.prompt, "--prompt"))[: args.max_tokens])
        y = torch.tensor(tok.encode(limits.text(args.target, "--target"))[: args.max_tokens])
        results = [
            attr.token_attribution(
                run.model, x, y, m, args.baseline_token, tok, n_steps=args.steps, n_samples=args.samples, seed=args.seed
            )
            for m in methods
        ]
        layers = layer_attribution(run.model, x, y, n_steps=args.steps) if args.layers else None
    except (AttributionError, CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab attribute: {exc}", file=sys.stderr)
        return 2
    figures = [(attribution_figure(r), r.table(), f"attribution_{r.method}") for r in results]
    data: dict[str, Any] = dict(run=str(args.run), prompt=args.prompt, target=args.target, methods={})
    for r in results:
        data["methods"][r.method] = dict(
            matrix=r.matrix.tolist(),
            input_tokens=r.input_labels,
            output_tokens=r.output_labels,
            baseline=r.baseline,
            delta=r.delta,
            difference=r.difference,
            **r.extra,
        )
        if r.delta is not None:
            print(f"k3lab attribute: {r.method} delta per output token {[round(d, 5) for d in r.delta]}")
            if "routing_changes" in r.extra:
                print(
                    f"k3lab attribute: {r.method}: the top-k expert sets changed {r.extra['routing_changes']:,} times"
                )
        warning = r.warning()
        if warning:
            print(f"k3lab attribute: {r.method}: {warning}")
    if layers is not None:
        figures.append((layer_attribution_figure(layers), layers.table, "attribution_layers"))
        data["layers"] = dict(
            table=layers.table.to_dict("records"),
            by_kind=layers.by_kind.to_dict("records"),
            f_model=layers.f_model,
            f_baseline=layers.f_baseline,
            delta=layers.delta,
            baseline=layers.baseline,
        )
    problems = _write(Path(args.out), "attribution.json", data, figures, not args.no_static)
    for p in problems:
        print(f"k3lab attribute: {p}", file=sys.stderr)
    return 1 if problems else 0
