"""Experiment: edit the forward pass, patch activations, attribute outputs, and inspect one token."""

from __future__ import annotations

import json
import time
from urllib.parse import urlencode

import numpy as np
import pandas as pd
import streamlit as st
import torch

from analysis import attribution, effects, job_memory, lens, patching
from analysis.figures.experiment import (
    attribution_figure,
    layer_attribution_figure,
    lens_figure,
    loss_change_figure,
    patching_figure,
)
from analysis.token_detail import token_detail
from app import caching, job_budget, links, page, picks
from app import experiment as ex
from app.errors import plain
from app.links import EDITS
from k3core.interventions import EditError, KDAEdit, compile_edits, edit_from_dict, intervene

inputs = page.inputs_or_stop()
page.page_header(
    "Experiment",
    "Ask causal questions: edit the forward pass (ban an expert, flatten a depth mix, pin a KDA decay, mask "
    "MLA keys, zero any activation) and see what changes per token; patch activations from a clean into a "
    "corrupted input; attribute a continuation to the prompt's tokens with Captum; inspect one token.",
)
loaded = page.load_or_stop(inputs)
page.show_input_notes(loaded)
page.run_line(loaded)
model, run, config = loaded.model, loaded.run, loaded.run.config
if model is None:  # a trace folder (analysis.runs.load_trace_folder): nothing to rerun
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


def _positions(values: list[int]) -> dict[int, str]:
    return {t: f"{t}: {label(int(ids[0, t]))}" for t in values}


def _build_edit() -> None:
    """The edit menus: kind and what it acts on (outside the form, the menus below depend on them), then
    the rest in a form whose button adds the edit."""
    kinds = [k for k in ex.KINDS if k != "attnres" or config.residual.endswith("attnres")]
    kinds = [k for k in kinds if k not in ("moe",) or ex.layers_with(config, "moe.selection")]
    kinds = [k for k in kinds if k != "mla" or ex.layers_with(config, "mla.key_mask")]
    c = st.columns(3)
    kind = c[0].selectbox("Edit", kinds, format_func=ex.KINDS.get, key="k3lab_exp_kind")
    data: dict = {"kind": kind}
    if kind == "attnres":
        sites = list(loaded.ctx.trace.meta.get("attnres_sources", {}))
        site = c[1].selectbox("Site", sites, key="k3lab_exp_site")
        sources = loaded.ctx.trace.meta["attnres_sources"][site]
        with st.form("k3lab_exp_form_attnres"):
            mode = st.selectbox("Depth weights", ("uniform", "one_hot", "mask"), key="k3lab_exp_mode")
            picked = st.multiselect("Source(s) (one-hot: the first; mask: all)", sources, key="k3lab_exp_sources")
            add = st.form_submit_button("Add edit", type="primary")
        data.update(site=site, mode=mode, sources=picked)
    else:
        point = {"moe": "moe.selection", "kda": "kda.g", "mla": "mla.key_mask"}.get(kind)
        if kind == "value":
            points = ex.value_points(config)
            point = c[1].selectbox("Hook point", points, key="k3lab_exp_point")
        layers = ex.layers_with(config, point) if point not in ("embed", "final_resid", "final_norm", "logits") else []
        with st.form(f"k3lab_exp_form_{kind}"):
            cols = st.columns(3)
            if kind == "value":
                chosen = cols[0].multiselect("Layers (none: all)", layers, key="k3lab_exp_layers") if layers else []
                op = cols[1].selectbox("Operation", ("zero", "scale", "add", "replace"), key="k3lab_exp_vop")
                value = cols[2].number_input("Value (factor or number)", value=0.0, key="k3lab_exp_value")
                data.update(point=point, op=op, layers=chosen or None, value=None if op == "zero" else value)
            else:
                layer = cols[0].selectbox("Layer", layers, key=f"k3lab_exp_layer_{kind}")
                ops = {
                    "moe": ("ban", "force", "uniform", "bias_off", "shared_off"),
                    "kda": KDAEdit.OPS,
                    "mla": ("mask_keys",),
                }[kind]
                op = cols[1].selectbox("Operation", ops, format_func=ex.OP_LABELS.get, key=f"k3lab_exp_op_{kind}")
                data.update(layer=layer, op=op)
                if kind == "moe":
                    picked = cols[2].multiselect("Experts", list(range(config.num_experts)), key="k3lab_exp_experts")
                    data["experts"] = picked
                elif kind == "kda":
                    value = cols[2].number_input("Value (g <= 0, or a factor)", value=0.0, key="k3lab_exp_kvalue")
                    where = st.number_input("Position (reset_state)", 0, T - 1, min(1, T - 1), key="k3lab_exp_pos")
                    chunk_names = ex.chunk_labels(T, config.kda_chunk_size)
                    chunks = st.multiselect(
                        "Chunks (the chunk-state operations)", list(chunk_names), format_func=chunk_names.get,
                        key="k3lab_exp_chunks",
                    )  # fmt: skip
                    if op in ("pin_g", "scale_g", "scale_beta", "scale_chunk_state"):
                        data["value"] = value
                    if op == "reset_state":
                        data["tokens"] = [int(where), int(where) + 1]
                    if op in ("reset_chunk_state", "scale_chunk_state"):
                        data["chunks"] = chunks
                else:
                    start = cols[2].number_input("First key masked", 0, T - 1, 0, key="k3lab_exp_k0")
                    stop = st.number_input("Keys masked up to (excluded)", 1, T, 1, key="k3lab_exp_k1")
                    data["keys"] = [int(start), int(stop)]
            add = st.form_submit_button("Add edit", type="primary")
    if add:
        try:
            edit = edit_from_dict(data)
            compile_edits(config, [edit])
        except EditError as exc:
            st.error(f"This edit cannot be applied: {plain(exc)}")
            return
        edits.append(edit.to_dict())
        st.rerun()


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
    if key not in results:
        with st.status("Running the baseline and the edited forward...", expanded=True) as status:
            bar = st.progress(0.0, text="baseline forward")
            start = time.perf_counter()
            try:
                parsed = [edit_from_dict(d) for d in edits]
                need = job_memory.experiment_peak_bytes(config, T)
                with (
                    job_budget.budget().admit(need, f"The experiment on {T:,} tokens", st.info),
                    caching.model_use(model),
                ):
                    exp = effects.run_experiment(model, ids.to(next(model.parameters()).device), parsed)
            except (EditError, ValueError, RuntimeError) as exc:
                status.update(label="The experiment failed", state="error")
                st.error(f"The experiment could not run: {plain(exc)}")
                return
            bar.progress(1.0, text="done")
            status.update(label=f"Experiment done in {time.perf_counter() - start:.1f} s", state="complete")
        ex.remember(results, key, exp)
    exp = results[key]
    ids_cpu = ids.cpu()
    exp_cpu = effects.Experiment(exp.edits, exp.base_logits.cpu(), exp.edited_logits.cpu())
    table = exp_cpu.effects(ids_cpu, label)
    summary = exp_cpu.summary(ids_cpu)
    st.markdown("#### Per-token loss change")
    c = st.columns(3)
    c[0].metric("Mean loss, baseline", f"{summary['base_loss']:.4f}")
    c[1].metric("Mean loss, edited", f"{summary['edited_loss']:.4f}", f"{summary['loss_change']:+.4f}")
    c[2].metric("Positions whose top-1 changed", summary["positions_changed_top1"])
    st.plotly_chart(loss_change_figure(table), key="k3lab_exp_loss_fig")
    st.dataframe(table, hide_index=True, key="k3lab_exp_table")
    worst = int(table.loss_change.abs().idxmax()) if len(table) else 0
    options = _positions(list(range(T)))
    chosen = st.multiselect(
        "Prediction changes at", list(options), default=[worst], format_func=options.get, key="k3lab_exp_at"
    )
    if chosen:
        changes = effects.prediction_changes(exp_cpu.base_logits, exp_cpu.edited_logits, chosen, 5, label)
        st.dataframe(changes, hide_index=True, key="k3lab_exp_changes")
    query = {**st.query_params.to_dict(), "mode": "edited", "section": "moe"}
    st.markdown(f"[Every diagnostics view, baseline vs edited, on the Compare page](/compare?{urlencode(query)})")


def _patching() -> None:
    st.caption(
        "The sidebar's text is the clean input; the corrupted one replaces one token. Each (layer, site) "
        "activation of the clean run is written into the corrupted run; the heatmap shows the fraction of "
        "the metric restored."
    )
    with st.form("k3lab_patch_form"):
        c = st.columns(3)
        where = c[0].number_input("Corrupt position", 0, T - 2, min(2, T - 2), key="k3lab_patch_pos")
        token = c[1].number_input("Replacement token id", 0, config.vocab_size - 1, 0, key="k3lab_patch_tok")
        metric_kind = c[2].selectbox("Metric", ("span_loss", "logit_diff"), key="k3lab_patch_metric")
        sites = st.multiselect("Sites", list(patching.SITES), default=list(patching.SITES), key="k3lab_patch_sites")
        per_position = st.checkbox("Per position (one site)", key="k3lab_patch_pp")
        go = st.form_submit_button("Run patching", type="primary")
    corrupted = ids.clone()
    corrupted[0, int(where)] = int(token)
    key = ("patch", loaded.key, int(where), int(token), metric_kind, tuple(sites), per_position)
    if go and key not in results:
        device = next(model.parameters()).device
        with torch.no_grad(), caching.model_use(model):
            clean_top = int(model(ids.to(device)).logits[0, -1].argmax())
            corrupt_top = int(model(corrupted.to(device)).logits[0, -1].argmax())
        if metric_kind == "logit_diff":
            metric = patching.Metric("logit_diff", clean_top, corrupt_top if corrupt_top != clean_top else 0)
        else:
            metric = patching.Metric("span_loss", start=int(where) + 1, stop=T)
        bar = st.progress(0.0, text="clean run")

        def progress(done: int, total: int, what: str) -> None:
            bar.progress(min(done / max(total, 1), 1.0), text=f"{what} ({done}/{total})")

        try:
            need = job_memory.patching_peak_bytes(config, T, len(sites))
            with job_budget.budget().admit(need, f"Patching over {T:,} tokens", st.info), caching.model_use(model):
                df = patching.activation_patching(
                    model,
                    ids.to(next(model.parameters()).device),
                    corrupted.to(next(model.parameters()).device),
                    metric,
                    sites=sites[:1] if per_position else sites,
                    per_position=per_position,
                    progress=progress,
                )
        except (patching.PatchingError, job_budget.JobRefused) as exc:
            st.error(plain(exc))
            return
        ex.remember(results, key, (df, metric))
    if key in results:
        df, metric = results[key]
        st.caption(f"Metric: {json.dumps(metric.to_dict())}")
        st.plotly_chart(patching_figure(df), key="k3lab_patch_fig")
        st.dataframe(df, hide_index=True, key="k3lab_patch_table")


def _attribution() -> None:
    with st.form("k3lab_attr_form"):
        c = st.columns(4)
        n = c[0].number_input("Prompt tokens", 1, max(1, T - 1), min(16, T - 1), key="k3lab_attr_n")
        m = c[1].number_input("Target tokens", 1, 16, 4, key="k3lab_attr_m")
        method = c[2].selectbox("Method", attribution.METHODS, key="k3lab_attr_method")
        baseline = c[3].number_input("Baseline token id", 0, config.vocab_size - 1, 0, key="k3lab_attr_base")
        layers = st.checkbox("Also attribute to layer kinds (KDA / MLA, dense / routed / shared)", key="k3lab_attr_l")
        go = st.form_submit_button("Run attribution", type="primary")
    n, m = int(n), int(min(m, T - n))
    key = ("attr", loaded.key, n, m, method, int(baseline), layers)
    if go and key not in results:
        x, y = ids[0, :n].cpu(), ids[0, n : n + m].cpu()
        need = job_memory.attribution_peak_bytes(config, n + m, method, layers=layers)
        try:
            with (
                st.spinner(f"{method} on {n} prompt and {m} target tokens..."),
                job_budget.budget().admit(need, f"Attribution ({method}) over {n + m:,} tokens", st.info),
                caching.model_use(model),
            ):
                tok = attribution.token_attribution(model, x, y, method, int(baseline), run.tokenizer)
                lay = attribution.layer_attribution(model, x, y) if layers else None
        except (attribution.AttributionError, job_budget.JobRefused) as exc:
            st.error(plain(exc))
            return
        ex.remember(results, key, (tok, lay))
    if key in results:
        tok, lay = results[key]
        st.plotly_chart(attribution_figure(tok), key="k3lab_attr_fig")
        if tok.delta is not None:
            st.caption(
                f"Integrated gradients: f(x) - f(baseline) per output token {np.round(tok.difference, 4).tolist()}, "
                f"convergence delta {np.round(tok.delta, 4).tolist()} (more steps shrink it)."
            )
        if lay is not None:
            st.plotly_chart(layer_attribution_figure(lay), key="k3lab_attr_layers")
            st.dataframe(lay.by_kind, hide_index=True, key="k3lab_attr_kinds")


def _lens() -> None:
    kind = "AttnRes lens" if config.residual.endswith("attnres") else "logit lens"
    st.caption(
        f"The {kind}: at each depth, what the model would predict if it stopped there (the output depth mix over "
        "the sources so far, the final norm and the LM head; for plain residuals the hidden state itself). The "
        "last depth is the model's own prediction. With edits, the edited forward's lens is shown beside."
    )
    value = st.radio("Colour", ("next_rank", "kl_to_final"), horizontal=True, key="k3lab_lens_value")
    runs_to_show = [("baseline", [])] + ([("edited", edits)] if edits else [])
    device = next(model.parameters()).device
    for name, chosen in runs_to_show:
        key = ("lens", loaded.key, json.dumps(chosen))
        if key not in results:
            with caching.model_use(model), intervene(model, [edit_from_dict(d) for d in chosen]):
                labels, logits = lens.lens_logits(model, ids.to(device))
            ex.remember(results, key, lens.lens_table(labels, logits.cpu(), ids.cpu(), 5, label))
        table = results[key]
        st.markdown(f"**{name}**")
        st.plotly_chart(lens_figure(table, value), key=f"k3lab_lens_fig_{name}")
        where = st.selectbox(
            "Position",
            list(range(T)),
            index=T - 2,
            key=f"k3lab_lens_pos_{name}",
            format_func=_positions(list(range(T))).get,
        )
        st.dataframe(table[table.position == where].drop(columns=["top_ids"]), hide_index=True)


def _token() -> None:
    trace = loaded.ctx.trace
    options = _positions(list(range(T)))
    position = st.selectbox("Token", list(options), format_func=options.get, key="k3lab_tok_pos")
    key = ("logits", loaded.key)
    if key not in results:
        with torch.no_grad(), caching.model_use(model):
            ex.remember(results, key, model(ids.to(next(model.parameters()).device)).logits.cpu())
    detail = token_detail(trace, results[key], int(position), top_k=5, token_label=label)
    s = detail.summary
    loss = "—" if s["loss"] is None else f"{s['loss']:.4f} nats"
    st.markdown(f"**Token {s['position']}: `{s['token']}`** → next `{s['next_token']}` · loss {loss}")
    c1, c2 = st.columns(2)
    c1.markdown("Top-5 predictions")
    c1.table(detail.top_k.set_index("rank"))
    with c2:
        st.markdown("Experts per MoE layer (by weight rank)")
        experts = detail.experts
        if len(experts):
            experts, _, _ = picks.table_pick(links.TOKEN_MOE, "Experts", experts, "MoE")
        st.table(experts.set_index(["layer", "rank"]))
    if len(detail.depth):
        st.markdown("AttnRes depth weights")
        st.dataframe(detail.depth.pivot(index="site", columns="source", values="weight"), key="k3lab_tok_depth")
    if len(detail.mla):
        st.markdown(f"MLA attention from token {s['position']} as the query")
        rows, choices, pick = picks.table_pick(links.TOKEN_MLA, "MLA attention", detail.mla, "MLA", allow_all=False)
        st.caption(
            f"{choices.label('layer', pick['layer'])}, {choices.label('head', pick['head'])}: keys 0..{s['position']}"
        )
        st.bar_chart(pd.DataFrame({"attention": rows.prob.to_numpy()}, index=[f"{k}" for k in rows.key]))
    elif trace.layer_indices("mla"):
        st.caption("MLA attention was not recorded: turn on attention recording in the sidebar.")
    if len(detail.kda):
        st.markdown("KDA gates (beta, output gate mean, mean log decay g) per layer and head")
        rows, _, _ = picks.table_pick(links.TOKEN_KDA, "KDA gates", detail.kda, "KDA")
        st.dataframe(rows, hide_index=True, key="k3lab_tok_kda")


# A radio, not st.tabs: only the chosen section runs, and the choice survives reruns (kept in the session).
section = st.radio("Section", SECTIONS, horizontal=True, key="k3lab_exp_section", label_visibility="collapsed")
links.write_edits(edits)
if section == "Edits":
    _build_edit()
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
