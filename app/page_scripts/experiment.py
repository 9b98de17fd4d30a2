"""Experiment: edit the forward pass, patch activations, attribute outputs, and inspect one token."""

from __future__ import annotations

import json
import time
from urllib.parse import urlencode

import numpy as np
import pandas as pd
import streamlit as st

from analysis.experiments import attribution, effects, patching
from analysis.experiments.attribution_inputs import AttributionError
from analysis.figures import experiment as fx
from analysis.metrics.token_detail import token_detail
from analysis.output.export import provenance, with_provenance_columns
from analysis.runs import job_memory
from app import page_registry
from app.render import cards, page_scaffold
from app.render.edit_form import edit_form
from app.render.errors import plain
from app.render.model_use import model_use
from app.server import job_budget
from app.state import experiment_choices as ex
from app.state import inputs as inp
from app.state import links, pickers
from app.state.links import EDITS
from k3core.interp.edit_kinds import EditError
from k3core.interp.interventions import edit_from_dict

inputs = page_scaffold.inputs_or_stop()
page_scaffold.page_header(
    "experiment",
    "Ask causal questions: edit the forward pass (ban an expert, flatten a depth mix, pin a KDA decay, mask "
    "MLA keys, zero any activation) and see what changes per token; patch activations from a clean into a "
    "corrupted input; attribute a continuation to the prompt's tokens with Captum; inspect one token.",
)
loaded = page_scaffold.load_or_stop(inputs)
page_scaffold.show_input_notes(loaded)
page_scaffold.run_line(loaded)
model, run, config = loaded.model, loaded.run, loaded.run.config
if model is None:  # a trace folder (analysis.runs.loading.load_trace_folder): nothing to rerun
    st.info(
        f"**{loaded.ref.label}** is a trace folder without its weights: experiments rerun the model, so this page "
        "needs the checkpoint."
    )
    st.stop()
ids = loaded.ctx.input_ids[:1]
T = int(ids.shape[1])
label = ex.token_labeler(run)
SECTIONS = ("Edits", "Patching", "Attribution", "Lens", "Token")
ss = st.session_state
results = ss.setdefault(ex.RESULTS, {})
edits: list[dict] = ss.setdefault(EDITS, [])


VIEWS = {view.key: view for view in fx.VIEWS}


def _draw(view_key: str, card: str = "", **spec: object) -> bool:
    """One experiment View drawn through app.render.cards (export, figure cache), its inputs in the view options;
    ``card`` tells apart two cards of one view on the page."""
    return cards.render_view(VIEWS[view_key], ex.with_spec(loaded, **spec), key=f"{view_key}{card}")


def _positions(values: list[int]) -> dict[int, str]:
    return {t: f"{t}: {label(int(ids[0, t]))}" for t in values}


def _download(df: pd.DataFrame, stem: str, label_text: str, **meta: object) -> None:
    """A CSV download of a result, led by the run, the text and its token count (and ``meta``)."""
    head = {**provenance(loaded.ctx), **meta}
    st.download_button(
        label_text,
        data=with_provenance_columns(df, head).to_csv(index=False),
        file_name=f"k3lab-{stem}.csv",
        mime="text/csv",
        key=f"k3lab_exp_dl_{stem}",
    )


def _edit_list() -> None:
    if not edits:
        st.caption("No edits yet: build one above and add it.")
        return
    st.markdown("**Edits** (applied together, in this order)")
    for k, d in enumerate(list(edits)):
        c1, c2 = st.columns([6, 1])
        c1.code(edit_from_dict(d).describe(), language=None)
        if c2.button("Remove", key=f"k3lab_exp_rm_{k}"):
            edits.pop(k)
            st.rerun()


def _experiment() -> None:
    key = ("edit", loaded.key, json.dumps(edits))
    auto = ss.pop("k3lab_exp_autorun", False)
    if key not in results and not (st.button("Run experiment", type="primary", key="k3lab_exp_run") or auto):
        return
    fresh = key not in results
    spec = ex.with_spec(loaded, edits=list(edits))
    with st.status("Running the baseline and the edited forward...", expanded=fresh) as status:
        start = time.perf_counter()
        try:
            need = job_memory.experiment_peak_bytes(config, T)
            with (
                job_budget.budget().admit(need, f"The experiment on {T:,} tokens", st.info),
                model_use(model, exclusive=True),
            ):
                table, summary = fx.experiment_effects(spec.ctx)
        except (EditError, ValueError, RuntimeError) as exc:
            status.update(label="The experiment failed", state="error")
            st.error(f"The experiment could not run: {plain(exc)}")
            return
        status.update(label=f"Experiment done in {time.perf_counter() - start:.1f} s", state="complete")
    ex.remember(results, key, True)
    history = ss.setdefault(ex.HISTORY, [])
    if fresh:
        history.append({"run": loaded.ref.label, **ex.history_row(edits, summary, T)})
    st.markdown("#### Per-token loss change")
    c = st.columns(3)
    c[0].metric("Mean loss, baseline", f"{summary['base_loss']:.4f}")
    # a loss increase is worse: warm (red), whichever way the arrow points
    c[1].metric(
        "Mean loss, edited", f"{summary['edited_loss']:.4f}", f"{summary['loss_change']:+.4f}", delta_color="inverse"
    )
    c[2].metric("Positions whose top-1 changed", summary["positions_changed_top1"])
    _draw("experiment_loss_change", edits=list(edits))
    st.dataframe(table, hide_index=True, key="k3lab_exp_table")
    _download(table, "per-token-loss", "Download per-token loss (CSV)", edits=json.dumps(edits))
    if len(history) > 1:
        st.markdown("**This session's experiments** (oldest first)")
        st.dataframe(pd.DataFrame(history), hide_index=True, key="k3lab_exp_history")
    worst = int(table.loss_change.abs().idxmax()) if len(table) else 0
    options = _positions(list(range(T)))
    chosen = st.multiselect(
        "Prediction changes at", list(options), default=[worst], format_func=options.get, key="k3lab_exp_at"
    )
    if chosen:
        with model_use(model, exclusive=True):
            base_logits, edited_logits = ex.experiment_logits(results, loaded, edits)
        changes = effects.prediction_changes(base_logits, edited_logits, chosen, 5, label)
        st.dataframe(changes, hide_index=True, key="k3lab_exp_changes")
    query = {**st.query_params.to_dict(), "mode": "edited", "section": "moe"}
    compare = page_registry.page("compare")
    link = compare.link(urlencode(query))
    st.markdown(f"[Every diagnostics view, baseline vs edited, on the {compare.title} page]({link})")


def _patching() -> None:
    st.caption(
        "The sidebar's text is the clean input; the corrupted one replaces one token. Each (layer, site) "
        "activation of the clean run is written into the corrupted run; the heatmap shows the fraction of "
        "the metric restored: (patched - corrupted) / (clean - corrupted)."
    )
    with st.form("k3lab_patch_form"):
        c = st.columns(3)
        where = c[0].number_input("Corrupt position", 0, T - 2, min(2, T - 2), key="k3lab_patch_pos")
        replacement = c[1].text_input("Replacement (one token of text)", " ", key="k3lab_patch_text")
        metric_kind = c[2].selectbox("Metric", ("span_loss", "logit_diff"), key="k3lab_patch_metric")
        c = st.columns(2)
        correct_text = c[0].text_input(
            "logit_diff: correct answer (empty: the clean run's top-1)", "", key="k3lab_patch_correct"
        )
        wrong_text = c[1].text_input(
            "logit_diff: wrong answer (empty: the corrupted run's top-1)", "", key="k3lab_patch_wrong"
        )
        sites = st.multiselect("Sites", list(patching.SITES), default=list(patching.SITES), key="k3lab_patch_sites")
        c = st.columns(3)
        per_position = c[0].checkbox("Per position (every selected site)", key="k3lab_patch_pp")
        first = c[1].number_input("Positions from", 0, T - 1, 0, key="k3lab_patch_from")
        last = c[2].number_input("to (excluded)", 1, T, T, key="k3lab_patch_to")
        confirm = st.checkbox("Run it even when it is a long job (the estimate is shown first)", key="k3lab_patch_ok")
        go = st.form_submit_button("Run patching", type="primary")
    try:
        token = ex.one_token(run, replacement, "the replacement")
        window = (int(first), int(last)) if per_position else None
        plan = patching.patch_plan(config, T, sites, None, per_position, window)
    except (ValueError, patching.PatchingError) as exc:
        st.error(plain(exc))
        return
    corrupted = ids.clone()
    corrupted[0, int(where)] = token
    key = ("patch", loaded.key, int(where), token, metric_kind, correct_text, wrong_text, tuple(sites), window)
    forwards = len(plan) + 2
    if go and key not in results:
        start = time.perf_counter()
        with model_use(model):
            clean_logits = effects.forward_logits(model, ids)[0, -1]
            corrupt_logits = effects.forward_logits(model, corrupted)[0, -1]
        seconds = (time.perf_counter() - start) / 2 * forwards
        if forwards > ex.CONFIRM_FORWARDS and not confirm:
            st.warning(
                f"This job runs {forwards:,} forwards ({len(plan):,} patches + the clean and corrupted runs), about "
                f"{seconds:,.0f} s at this machine's speed. Tick 'Run it even when it is a long job' to run it, or "
                "narrow the sites, the positions or turn off per position."
            )
            return
        try:
            if metric_kind == "logit_diff":
                correct = ex.one_token(run, correct_text, "the correct answer") if correct_text else None
                wrong = ex.one_token(run, wrong_text, "the wrong answer") if wrong_text else None
                correct = int(clean_logits.argmax()) if correct is None else correct
                wrong = int(corrupt_logits.argmax()) if wrong is None else wrong
                if correct == wrong:
                    raise ValueError(
                        f"the correct and the wrong answer are the same token ({label(correct)!r}): type a wrong "
                        "answer (the clean and the corrupted run predict the same top-1)"
                    )
                metric = patching.Metric("logit_diff", correct, wrong)
            else:
                metric = patching.Metric("span_loss", start=int(where) + 1, stop=T)
        except (ValueError, patching.PatchingError) as exc:
            st.error(plain(exc))
            return
        spec = fx.patching_spec(int(where), token, metric.to_dict(), list(sites), per_position, window)
        try:
            need = job_memory.patching_peak_bytes(config, T, len(sites))
            with (
                st.spinner(f"Patching: {forwards:,} forwards..."),
                job_budget.budget().admit(need, f"Patching over {T:,} tokens", st.info),
                model_use(model, exclusive=True),
            ):
                fx.experiment_patching(ex.with_spec(loaded, patching=spec).ctx)
        except (patching.PatchingError, job_budget.JobRefused) as exc:
            st.error(plain(exc))
            return
        ex.remember(results, key, (spec, metric))
    elif key not in results:
        st.caption(f"This job: {forwards:,} forwards.")
    if key in results:
        spec, metric = results[key]
        with model_use(model, exclusive=True):  # the cached result (computed again if it was dropped)
            df = fx.experiment_patching(ex.with_spec(loaded, patching=spec).ctx)
        clean, corrupt = df.attrs["clean_metric"], df.attrs["corrupted_metric"]
        c = st.columns(3)
        c[0].metric(f"Clean {metric.kind}", f"{clean:.4f}")
        c[1].metric(f"Corrupted {metric.kind}", f"{corrupt:.4f}")
        c[2].metric("Gap (clean - corrupted)", f"{clean - corrupt:+.4f}", delta_color="off")
        if df.attrs.get("gap_warning"):
            st.warning(df.attrs["gap_warning"])
        answers = (
            f"correct {label(metric.correct)!r} (id {metric.correct}), wrong {label(metric.wrong)!r} "
            f"(id {metric.wrong}) at the last position"
            if metric.kind == "logit_diff"
            else f"mean next-token loss of positions {metric.start}..{metric.stop - 1}"
        )
        st.caption(
            f"Corrupted: position {int(where)} {label(int(ids[0, int(where)]))!r} -> {label(token)!r}. Metric: "
            f"{answers}."
        )
        _draw("experiment_patching", patching=spec)
        if df.by_construction.any():
            st.caption(
                "The resid rows over every position are 1 by construction: patching the whole residual stream "
                "entering a layer makes the corrupted run the clean run from there on. They are the reference "
                "scale, not a finding; per position, resid says where the information sits."
            )
        st.dataframe(df, hide_index=True, key="k3lab_patch_table")
        _download(df, "patching", "Download patching (CSV)", metric=json.dumps(metric.to_dict()))


def _attribution() -> None:
    with st.form("k3lab_attr_form"):
        c = st.columns(4)
        n = c[0].number_input("Prompt tokens", 1, max(1, T - 1), min(16, T - 1), key="k3lab_attr_n")
        m = c[1].number_input("Target tokens", 1, 16, 4, key="k3lab_attr_m")
        method = c[2].selectbox("Method", attribution.METHODS, key="k3lab_attr_method")
        baseline_text = c[3].text_input("Baseline (one token of text)", " ", key="k3lab_attr_base_text")
        target_text = st.text_input(
            "Target continuation as text (empty: the text's next tokens after the prompt)", "", key="k3lab_attr_target"
        )
        c = st.columns(3)
        steps = c[0].number_input("IG steps", 4, 512, 64, key="k3lab_attr_steps")
        samples = c[1].number_input("Shapley samples", 1, 64, 8, key="k3lab_attr_samples")
        seed = c[2].number_input("Shapley seed", 0, 2**31 - 1, 0, key="k3lab_attr_seed")
        layers = st.checkbox("Also attribute to layer kinds (KDA / MLA, dense / routed / shared)", key="k3lab_attr_l")
        go = st.form_submit_button("Run attribution", type="primary")
    n = int(n)
    try:
        baseline = ex.one_token(run, baseline_text, "the baseline")
        target = ex.text_ids(run, target_text, "the target")[:16] if target_text else None
    except ValueError as exc:
        st.error(plain(exc))
        return
    y = list(target) if target else ids[0, n : n + int(min(m, T - n))].tolist()
    key = ("attr", loaded.key, n, tuple(y), method, baseline, int(steps), int(samples), int(seed), layers)
    # plain IG is shown beside the frozen-routing one (and the other way round) on MoE models
    methods = [method]
    if method in attribution.IG_METHODS and config.num_experts:
        methods = list(attribution.IG_METHODS)
    specs = [fx.attribution_spec(n, y, mth, baseline, int(steps), int(samples), int(seed)) for mth in methods]
    if go and key not in results:
        running = f"{', '.join(methods)} on {n} prompt and {len(y)} target tokens..."
        need = max(job_memory.attribution_peak_bytes(config, n + len(y), mth, int(steps), layers) for mth in methods)
        try:
            admitted = job_budget.budget().admit(need, f"Attribution over {n + len(y):,} tokens", st.info)
            with st.spinner(running), admitted, model_use(model, exclusive=True):
                for spec in specs:
                    fx.experiment_token_attribution(ex.with_spec(loaded, attribution=spec).ctx)
                if layers:
                    fx.experiment_layer_attribution(ex.with_spec(loaded, attribution=specs[0]).ctx)
        except (AttributionError, job_budget.JobRefused) as exc:
            st.error(plain(exc))
            return
        ex.remember(results, key, True)
    if key in results:
        cols = st.columns(len(specs))
        for col, spec in zip(cols, specs):
            with col:
                _draw("experiment_attribution", f"_{spec['method']}", attribution=spec)
                with model_use(model, exclusive=True):
                    tok = fx.experiment_token_attribution(ex.with_spec(loaded, attribution=spec).ctx)
                _attribution_notes(tok)
                _download(tok.table(), f"attribution-{tok.method}", f"Download {tok.method} (CSV)", **tok.extra)
        if layers:
            _draw("experiment_layer_attribution", attribution=specs[0])
            with model_use(model, exclusive=True):
                lay = fx.experiment_layer_attribution(ex.with_spec(loaded, attribution=specs[0]).ctx)
            st.dataframe(lay.by_kind, hide_index=True, key="k3lab_attr_kinds")


def _attribution_notes(tok: attribution.TokenAttribution) -> None:
    """How much to trust one attribution: its completeness (IG), routing changes, samples and seed (Shapley)."""
    if tok.delta is not None:
        shares = tok.delta_share()
        st.caption(
            f"{tok.method}: f(x) - f(baseline) per output token {np.round(tok.difference, 4).tolist()}, "
            f"delta {np.round(tok.delta, 4).tolist()} ({max(shares):.1%} of it at most)"
            + (
                f"; top-k expert sets changed {tok.extra['routing_changes']:,} times along the path"
                if "routing_changes" in tok.extra
                else ""
            )
            + (f"; {tok.extra['path_points']:,} path points" if "path_points" in tok.extra else "")
        )
    elif tok.method == "shapley":
        st.caption(f"Shapley values from {tok.extra['n_samples']} sampled permutations, seed {tok.extra['seed']}.")
    warning = tok.warning()
    if warning:
        st.warning(f"{tok.method}: {warning}")


def _lens() -> None:
    kind = "AttnRes lens" if config.residual.endswith("attnres") else "logit lens"
    st.caption(
        f"The {kind}: at each depth, what the model would predict if it stopped there (the output depth mix over "
        "the sources so far, the final norm and the LM head; for plain residuals the hidden state itself). The "
        "last depth is the model's own prediction. With edits, the edited forward's lens is shown beside."
    )
    value = st.radio("Colour", ("next_rank", "kl_to_final"), horizontal=True, key="k3lab_lens_value")
    runs_to_show = [("baseline", [])] + ([("edited", edits)] if edits else [])
    for name, chosen in runs_to_show:
        spec = {"edits": list(chosen), "lens_value": value}
        with model_use(model, exclusive=True):
            table = fx.experiment_lens(ex.with_spec(loaded, **spec).ctx)
        st.markdown(f"**{name}**")
        _draw("experiment_lens", f"_{name}", **spec)
        where = st.selectbox(
            "Position",
            list(range(T)),
            index=T - 2,
            key=f"k3lab_lens_pos_{name}",
            format_func=_positions(list(range(T))).get,
        )
        shown = lens_rows(table[table.position == where])
        st.dataframe(
            shown,
            hide_index=True,
            column_config={"top predictions": st.column_config.TextColumn(width="large")},
            **cards.DATAFRAME_KW,
        )


def lens_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The lens table as shown: each depth's top tokens and probabilities as one readable column ("␣the 0.412 ·
    ..."), numbers to 4 significant digits (the CSV / JSON exports keep full precision)."""
    top = [
        " · ".join(f"{tok} {p:.3f}" for tok, p in zip(toks, probs))
        for toks, probs in zip(rows["top_tokens"], rows["top_probs"])
    ]
    shown = rows.drop(columns=["top_ids", "top_tokens", "top_probs"]).assign(**{"top predictions": top})
    for column in shown.select_dtypes("float").columns:
        shown[column] = shown[column].map(lambda v: float(f"{v:.4g}"))
    return shown


def _token() -> None:
    trace = loaded.ctx.trace
    options = _positions(list(range(T)))
    # opens on the last token with a next token (token 0's MLA attention is one full-height bar on key 0)
    position = st.selectbox("Token", list(options), index=max(0, T - 2), format_func=options.get, key="k3lab_tok_pos")
    key = ("logits", loaded.key)
    if key not in results:
        with model_use(model):
            ex.remember(results, key, effects.forward_logits(model, ids))
    detail = token_detail(trace, results[key], int(position), top_k=5, token_label=label)
    s = detail.summary
    loss = "—" if s["loss"] is None else f"{s['loss']:.4f} nats"
    st.markdown(f"**Token {s['position']}: `{s['token']}`** → next `{s['next_token']}` · loss {loss}")
    c1, c2 = st.columns(2)
    c1.markdown("Top-5 predictions")
    c1.table(detail.top_k.set_index("rank").assign(prob=lambda d: d["prob"].map("{:.4f}".format)))
    with c2:
        st.markdown("Experts per MoE layer (by weight rank)")
        experts = detail.experts
        if len(experts):
            experts, _, _ = pickers.table_pick(links.TOKEN_MOE, "Experts", experts, "MoE")
        st.table(experts.set_index(["layer", "rank"]))
    if len(detail.depth):
        st.markdown("AttnRes depth weights")
        st.dataframe(detail.depth.pivot(index="site", columns="source", values="weight"), key="k3lab_tok_depth")
    if len(detail.mla):
        st.markdown(f"MLA attention from token {s['position']} as the query")
        rows, choices, pick = pickers.table_pick(links.TOKEN_MLA, "MLA attention", detail.mla, "MLA", allow_all=False)
        st.caption(
            f"{choices.label('layer', pick['layer'])}, {choices.label('head', pick['head'])}: keys 0..{s['position']}"
        )
        what = f"{choices.label('layer', pick['layer'])}, {choices.label('head', pick['head'])}"
        fig = fx.mla_attention_figure(rows, int(s["position"]), what)
        stem = f"{cards.slug(loaded.ctx.label)}_mla_attention_from_{int(s['position'])}"
        cards.figure_card(fig, rows, key="k3lab_tok_mla_fig", stem=stem)
    elif trace.layer_indices("mla"):
        st.caption(f"MLA attention was not recorded: turn on *{inp.ATTENTION_CHECKBOX}* in the sidebar.")
    if len(detail.kda):
        st.markdown("KDA gates (beta, output gate mean, mean log decay g) per layer and head")
        rows, _, _ = pickers.table_pick(links.TOKEN_KDA, "KDA gates", detail.kda, "KDA")
        st.dataframe(rows, hide_index=True, key="k3lab_tok_kda")


# A radio, not st.tabs: only the chosen section runs, and the choice survives reruns (kept in the session).
section = st.radio("Section", SECTIONS, horizontal=True, key="k3lab_exp_section", label_visibility="collapsed")
links.write_edits(edits)
if section == "Edits":
    edit_form(config, loaded.ctx.trace.meta.get("attnres_sources", {}), T, edits)
    _edit_list()
    if edits:
        _experiment()
elif section == "Patching":
    _patching()
elif section == "Attribution":
    _attribution()
elif section == "Lens":
    _lens()
else:
    _token()
