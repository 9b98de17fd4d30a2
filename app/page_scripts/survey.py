"""Survey: statistics of the chosen run over a corpus (analysis.survey.engine), its expert atlas and expert-cache
curves."""

from __future__ import annotations

import re

import streamlit as st

from analysis.figures import survey as fs
from analysis.figures.style import screen_figure
from analysis.runs.texts import text_tokenizer
from analysis.survey import engine as sv
from analysis.survey import tables
from analysis.survey.folder import is_survey_dir, read_survey
from analysis.survey.plan import SURVEY_SAMPLES, SurveyError, corpus_ids, make_plan, sample_corpus_text
from analysis.views.view import NotApplicable
from app.render import page_scaffold
from app.render.cards import CHART_KW, PLOTLY_CONFIG
from app.server import survey_jobs

inputs = page_scaffold.inputs_or_stop()
page_scaffold.page_header(
    "survey",
    "Statistics over every token of a corpus, kept as bounded aggregates: MoE load with its interval, balance, "
    "margins, an expert atlas (click a mark of the load map to open the expert's card) and what an expert cache "
    "would hit (LRU, LFU, Belady). A survey is saved as it runs; Stop keeps what is done and Start continues.",
)

run = page_scaffold.run_or_stop(inputs, needs_weights=True)
c1, c2, c3, c4 = st.columns(4)
corpus = c1.selectbox("Corpus", tuple(SURVEY_SAMPLES), help="; ".join(f"{k}: {v}" for k, v in SURVEY_SAMPLES.items()))
tokens = int(c2.number_input("Corpus tokens", min_value=512, max_value=50_000_000, value=50_000, step=10_000))
seq_len = int(c3.number_input("Sequence length", min_value=8, max_value=65536, value=sv.default_seq_len(run)))
batch = int(c4.number_input("Sequences per forward", min_value=1, max_value=256, value=8))


@st.cache_data(show_spinner="Reading the corpus…", max_entries=8)
def _ids(name: str, n: int, vocab: int, tokenizer_name: str):
    return corpus_ids(sample_corpus_text(name), text_tokenizer(run.config, run.tokenizer), n)


try:
    ids = _ids(corpus, tokens, run.config.vocab_size, getattr(run.tokenizer, "name", "bytes"))
    plan = make_plan(ids, corpus, run.fingerprint, seq_len, batch)
except ValueError as exc:
    st.error(str(exc))
    st.stop()

slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{run.label}-{corpus}-{plan.tokens}-{seq_len}")
folder = survey_jobs.surveys_dir() / slug
key = f"k3lab_survey_cost_{slug}"
if key not in st.session_state:
    with st.spinner("Timing one batch for the cost estimate…"):
        st.session_state[key] = sv.estimate_seconds(run, ids, plan)
seconds = st.session_state[key]
st.markdown(
    f"**Cost:** {plan.sequences:,} sequences x {seq_len} = **{plan.tokens:,} tokens** in {plan.batches:,} forwards; "
    f"about **{seconds:,.0f} s** here ({plan.tokens / max(seconds, 1e-9):,.0f} tokens/s, from one timed batch). "
    f"Folder: `{folder}`."
)
job = survey_jobs.job_of(folder)
b1, b2, _ = st.columns([1, 1, 6])
if b1.button("Start" if not is_survey_dir(folder) else "Continue", disabled=bool(job and job.running)):
    job = survey_jobs.start(run, ids, plan, folder)
if b2.button("Stop", disabled=not (job and job.running)):
    job.stop.set()


def _chart(fig, key: str, **select):
    """A figure as every app page draws it: its own look (theme None), the lighter screen copy."""
    return st.plotly_chart(screen_figure(fig), key=key, config=PLOTLY_CONFIG, theme=None, **CHART_KW, **select)


def _results(folder, job) -> None:
    if job is not None:
        if job.error:
            st.error(f"The survey failed: {job.error}")
        elif job.running:
            eta = job.eta_seconds()
            st.progress(
                job.done / max(job.total, 1),
                text=f"{job.done:,} of {job.total:,} forwards" + (f", about {eta:,.0f} s left" if eta else ""),
            )
    if not is_survey_dir(folder):
        st.info("No results yet: press Start.")
        return
    try:
        survey = read_survey(folder)
    except SurveyError as exc:
        st.error(str(exc))
        return
    st.caption(tables.summary_text(survey).splitlines()[0])
    ctx = fs.survey_context(survey)
    try:
        fig, _ = fs.load_map(ctx)
    except NotApplicable as exc:
        st.info(str(exc))
        return
    picked = _chart(fig, "k3lab_survey_load", on_select="rerun", selection_mode="points")
    options = {}
    try:
        points = picked["selection"]["points"] if picked is not None else []
    except (KeyError, TypeError):
        points = []
    if points and "x" in points[0] and "y" in points[0]:
        # the mark's own position (x = expert, y = layer): its customdata row arrives as a {"0": ..} object, the
        # screen copy sends it as a typed array, which the selection event serialises that way
        options = {"layer": int(points[0]["y"]), "expert": int(points[0]["x"])}
    if not options:  # no mark selected: the pickers (default: the most specialised expert)
        best = tables.expert_table(survey).sort_values("specialisation_bits", ascending=False).iloc[0]
        p1, p2, _ = st.columns([1, 1, 4])
        layers = survey.layout.moe_layers
        layer = p1.selectbox("Atlas card: MoE layer", layers, index=layers.index(int(best.layer)))
        expert = p2.selectbox("expert", range(survey.layout.num_experts), index=int(best.expert))
        options = {"layer": int(layer), "expert": int(expert)}
    else:
        st.caption(f"Atlas card of layer {options['layer']} expert {options['expert']} (selected on the load map).")
    card, card_table = fs.atlas_card(ctx.with_options(**options))
    _chart(card, "k3lab_survey_card")
    budget = None
    if inputs.max_memory:
        try:
            from k3core.interp.trace_size import trace_estimate
            from k3core.loading.streamed_run import plan_for_path
            from k3core.modeling.model import K3ForCausalLM

            plan = plan_for_path(run.path, K3ForCausalLM, max_memory=inputs.max_memory, trace_estimate=trace_estimate)
            budget = plan.expert_cache_bytes
        except Exception:  # noqa: BLE001 - no budget mark then
            budget = None
    fig, cache = fs.cache_curves(ctx.with_options(budget_bytes=budget))
    _chart(fig, "k3lab_survey_cache")
    if budget:
        st.caption(f"Dotted line: the expert cache the streaming plan chooses for {inputs.max_memory}.")
    for view in (fs.balance, fs.cutoff_histograms, fs.loss_by_position):
        _chart(view(ctx)[0], f"k3lab_survey_{view.__name__}")
    others = [p for p in survey_jobs.survey_folders() if p != folder]
    if others:
        other = st.selectbox("Compare with", [None, *others], format_func=lambda p: "—" if p is None else p.name)
        if other is not None:
            _chart(fs.compare_surveys(survey, read_survey(other), folder.name, other.name)[0], "k3lab_survey_cmp")
    d1, d2, d3 = st.columns(3)
    d1.download_button("Experts (CSV)", tables.expert_table(survey).to_csv(index=False), f"{slug}-experts.csv")
    d2.download_button("Atlas (CSV)", tables.atlas_table(survey).to_csv(index=False), f"{slug}-atlas.csv")
    d3.download_button("Cache (JSON)", cache.to_json(orient="records"), f"{slug}-cache.json")


@st.fragment(run_every=2.0 if (job and job.running) else None)
def _live() -> None:
    current = survey_jobs.job_of(folder)
    if current is not None and current.finished and job is not None and job.running:
        st.rerun(scope="app")  # the survey ended: draw the page once more without the 2 s refresh
    _results(folder, current)


_live()
