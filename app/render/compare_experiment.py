"""Compare's Experiment section: the Experiment page's views (``analysis.figures.experiment``) for A and B side by side,
the same experiment on each.

The edits are the Experiment page's list, applied to each run where they apply (a message names the run and the
reason where they do not); one patching choice (a corrupted position and its replacement, span loss after it) and one
attribution choice (prompt length, method, baseline; each text's next tokens as the target) serve both runs. What the
choices cost, in forward passes and seconds per run, is shown first; nothing runs before the button. The figures are
drawn by ``app.render.cards.render_comparison``: shared axes and the exports of every other Compare figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import streamlit as st

from analysis.experiments import attribution, patching
from analysis.figures import experiment as fx
from analysis.runs import job_memory
from analysis.views.catalogue import section_views
from app import page_registry
from app.render import caching, cards
from app.render.caching import Loaded
from app.render.errors import md_escape, plain
from app.render.model_use import model_use
from app.server import job_budget
from app.state import experiment_choices as ex
from k3core.interp.edit_kinds import EditError
from k3core.interp.interventions import compile_edits, edit_from_dict

DONE = "k3lab_cmp_exp_done"  # session key: the (A, B, choices) whose experiments have run
LENS_VALUES = ("next_rank", "kl_to_final")


@dataclass
class Plan:
    """One run's part of the experiment: the view options of each view, the forwards they cost (fewest, most), and
    what does not apply to this run (sentences)."""

    loaded: Loaded
    specs: dict[str, dict] = field(default_factory=dict)  # view key -> its options (fx.EDITS, fx.PATCHING, ...)
    forwards: list[int] = field(default_factory=lambda: [0, 0])
    problems: list[str] = field(default_factory=list)

    def add(self, view_key: str, spec: dict, fewest: int, most: int | None = None) -> None:
        self.specs[view_key] = spec
        self.forwards[0] += fewest
        self.forwards[1] += most if most is not None else fewest


def edits_problem(loaded: Loaded, edits: list[dict]) -> str | None:
    """Why the edits do not apply to this run's model (None: they do)."""
    try:
        compile_edits(loaded.run.config, [edit_from_dict(d) for d in edits])
    except EditError as exc:
        return plain(exc)
    return None


def _choices(tokens: int) -> dict | None:
    """The form: lens colour, patching and attribution choices shared by A and B; None until it is submitted once."""
    with st.form("k3lab_cmp_exp_form"):
        c = st.columns(3)
        lens_value = c[0].radio("Lens colour", LENS_VALUES, horizontal=True, key="k3lab_cmp_exp_lens")
        do_patch = c[1].checkbox("Activation patching", key="k3lab_cmp_exp_patch", disabled=tokens < 3)
        do_attr = c[2].checkbox("Attribution", key="k3lab_cmp_exp_attr", disabled=tokens < 2)
        c = st.columns(2)
        last = max(0, tokens - 2)
        where = c[0].number_input("Patching: corrupt position", 0, last, min(2, last), key="k3lab_cmp_exp_pos")
        replacement = c[1].text_input("Patching: replacement (one token of text)", " ", key="k3lab_cmp_exp_repl")
        c = st.columns(4)
        most = max(1, tokens - 1)
        n = c[0].number_input("Attribution: prompt tokens", 1, most, min(16, most), key="k3lab_cmp_exp_n")
        method = c[1].selectbox("Method", attribution.METHODS, key="k3lab_cmp_exp_method")
        steps = c[2].number_input("IG steps", 4, 512, 64, key="k3lab_cmp_exp_steps")
        baseline = c[3].text_input("Baseline (one token of text)", " ", key="k3lab_cmp_exp_base")
        layers = st.checkbox("Also layer attribution (IG over sub-layer outputs)", key="k3lab_cmp_exp_layers")
        submitted = st.form_submit_button("Estimate the cost")
    if submitted:
        st.session_state["k3lab_cmp_exp_choices"] = {
            "lens_value": lens_value,
            "patching": {"position": int(where), "replacement": replacement} if do_patch else None,
            "attribution": (
                {"prompt_tokens": int(n), "method": method, "steps": int(steps), "baseline": baseline, "layers": layers}
                if do_attr
                else None
            ),
        }
    return st.session_state.get("k3lab_cmp_exp_choices")


def plan(loaded: Loaded, edits: list[dict], choices: dict, lens_edits: list[dict]) -> Plan:
    """What the experiment runs on one run, its cost, and what does not apply there. ``lens_edits``: the edits the
    lens of both runs applies (none unless the edits apply to both: an edited lens beside a baseline one compares
    nothing)."""
    out = Plan(loaded)
    run, tokens = loaded.run, int(loaded.ctx.input_ids.shape[1])
    problem = edits_problem(loaded, edits) if edits else None
    if problem:
        out.problems.append(f"the edits do not apply to this run: {problem}")
    elif edits:
        out.add("experiment_loss_change", {fx.EDITS: edits}, 2)  # the baseline and the edited forward
    out.add("experiment_lens", {fx.EDITS: lens_edits, fx.LENS_VALUE: choices["lens_value"]}, 1)
    if choices.get("patching"):
        p = choices["patching"]
        try:
            token = ex.one_token(run, p["replacement"], "the replacement")
            if not 0 <= p["position"] < tokens - 1:
                raise ValueError(f"position {p['position']} is not before the last of this text's {tokens} tokens")
            metric = patching.Metric("span_loss", start=p["position"] + 1, stop=tokens)
            forwards = len(patching.patch_plan(run.config, tokens)) + 2
            out.add(
                "experiment_patching", {fx.PATCHING: fx.patching_spec(p["position"], token, metric.to_dict())}, forwards
            )
        except (ValueError, patching.PatchingError) as exc:
            out.problems.append(f"patching: {plain(exc)}")
    if choices.get("attribution"):
        a = choices["attribution"]
        try:
            base = ex.one_token(run, a["baseline"], "the baseline")
            n = min(a["prompt_tokens"], tokens - 1)
            m = min(4, tokens - n)  # the target: the text's next tokens after the prompt (fx.attribution_spec)
            spec = {fx.ATTRIBUTION: fx.attribution_spec(n, None, a["method"], base, a["steps"])}
            moe = bool(run.config.num_experts)
            out.add(
                "experiment_attribution",
                spec,
                *attribution.attribution_forwards(a["method"], n, m, a["steps"], moe=moe),
            )
            if a["layers"]:
                out.add(
                    "experiment_layer_attribution", spec, *attribution.attribution_forwards("layers", n, m, a["steps"])
                )
        except ValueError as exc:
            out.problems.append(f"attribution: {plain(exc)}")
    return out


def estimate(p: Plan) -> str:
    """One run's cost as a sentence: forward passes and, once a forward of this run was timed, seconds."""
    loaded = p.loaded
    low, high = p.forwards
    count = f"{low:,}" if low == high else f"{low:,}-{high:,}"
    tokens = int(loaded.ctx.input_ids.shape[1])
    run = loaded.run
    measured = caching.forward_speed(run.fingerprint, run.device, run.dtype)
    if measured:
        s_low = caching.forward_seconds_range(measured, tokens)[0] * low
        s_high = caching.forward_seconds_range(measured, tokens)[1] * high
        seconds = f"about {s_low:,.1f} s" if s_high < 1.5 * s_low else f"about {s_low:,.1f}-{s_high:,.1f} s"
    else:
        seconds = "time not measured yet for this run"
    return f"**{md_escape(loaded.ctx.label)}**: {count} forward passes on {tokens:,} tokens, {seconds}"


def _compute(p: Plan) -> None:
    """Every chosen experiment of one run, kept on its context (``AnalysisContext.once``), under the job budget."""
    loaded, config = p.loaded, p.loaded.run.config
    tokens = int(loaded.ctx.input_ids.shape[1])
    need = job_memory.experiment_peak_bytes(config, tokens)
    if "experiment_patching" in p.specs:
        need = max(need, job_memory.patching_peak_bytes(config, tokens, len(patching.SITES)))
    if "experiment_attribution" in p.specs:
        spec = p.specs["experiment_attribution"][fx.ATTRIBUTION]
        need = max(need, job_memory.attribution_peak_bytes(config, tokens, spec["method"], spec["steps"]))
    compute = {
        "experiment_loss_change": fx.experiment_effects,
        "experiment_lens": fx.experiment_lens,
        "experiment_patching": fx.experiment_patching,
        "experiment_attribution": fx.experiment_token_attribution,
        "experiment_layer_attribution": fx.experiment_layer_attribution,
    }
    with (
        job_budget.budget().admit(need, f"The experiment on {loaded.ctx.label}", st.info),
        model_use(loaded.model, exclusive=True),
    ):
        for key, spec in p.specs.items():
            compute[key](ex.with_spec(loaded, **spec).ctx)


def section(a: Loaded, b: Loaded, edits: list[dict], edited_mode: bool) -> None:
    """Compare's Experiment section for runs A and B (``edits``: the Experiment page's list)."""
    experiment = page_registry.page("experiment")
    if edited_mode:
        st.info(
            f"Baseline vs edited already puts the edits in B. Compare two runs or one run on two texts to see the same "
            f"experiment on each; the {experiment.mention} shows baseline against edited per token."
        )
        return
    without = [x.ctx.label for x in (a, b) if x.model is None or x.ctx.input_ids is None]
    if without:
        st.info(
            f"**{md_escape(', '.join(without))}**: a trace folder without its weights; experiments rerun the model, "
            "so this section needs both checkpoints."
        )
        return
    if edits:
        st.caption(
            f"Edits (the {experiment.title} page's list): " + "; ".join(edit_from_dict(d).describe() for d in edits)
        )
    else:
        st.caption(
            f"No edits: the loss change needs edits (build them on the {experiment.mention}); the lens is each "
            "run's own."
        )
    tokens = min(int(x.ctx.input_ids.shape[1]) for x in (a, b))
    choices = _choices(tokens)
    if choices is None:
        st.caption("Choose the experiments and estimate their cost: nothing runs before you confirm it.")
        return
    both = bool(edits) and all(edits_problem(x, edits) is None for x in (a, b))
    plans = [plan(x, edits, choices, edits if both else []) for x in (a, b)]
    for p in plans:
        for problem in p.problems:
            st.warning(f"**{md_escape(p.loaded.ctx.label)}**: {md_escape(problem)}")
    st.markdown("This experiment runs " + " · ".join(estimate(p) for p in plans) + ".")
    key = (a.key, b.key, json.dumps(edits), json.dumps(choices, sort_keys=True))
    done = st.session_state.setdefault(DONE, set())
    if key not in done:
        if not st.button("Run on A and B", type="primary", key="k3lab_cmp_exp_run"):
            return
        try:
            with st.spinner("Running the experiment on A and B..."):
                for p in plans:
                    _compute(p)
        except (EditError, ValueError, RuntimeError, job_budget.JobRefused) as exc:
            st.error(f"The experiment could not run: {plain(exc)}")
            return
        done.add(key)
    # the results are kept on the contexts; a dropped one is computed again by the build (view_cache.build_view holds
    # the model for a view that runs it)
    for view in section_views("experiment"):
        in_a, in_b = (view.key in p.specs for p in plans)
        if in_a and in_b:
            cards.render_comparison(
                view, ex.with_spec(a, **plans[0].specs[view.key]), ex.with_spec(b, **plans[1].specs[view.key])
            )
        elif in_a or in_b:
            p = plans[0] if in_a else plans[1]
            st.caption(f"**{view.title}**: only {md_escape(p.loaded.ctx.label)} (see the warning above).")
            cards.render_view(view, ex.with_spec(p.loaded, **p.specs[view.key]), key=f"cmp-one-{view.key}")
        else:
            st.caption(f"**{view.title}**: not chosen.")
