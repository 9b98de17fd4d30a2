"""Corpus surveys (analysis.survey.engine): every statistic equals a brute-force computation from per-text hook reads;
an interrupted survey continues to the same state; the folder reads back without the weights, hostile ones refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.metrics import expert_cache as ec
from analysis.runs.loading import load_run
from analysis.runs.texts import text_tokenizer
from analysis.survey import engine as sv
from analysis.survey.aggregates import uniform_hash
from analysis.survey.folder import CARD_NAME, STATE_NAME, read_survey
from analysis.survey.plan import SurveyError, attnres_sites, batch_ids, corpus_ids, make_plan
from analysis.survey.state import SurveyState
from k3core.interp.catalogue import POINTS
from k3core.modeling.hooks import HookNames, hooks
from k3core.training.load_stats import moe_load_stats

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"
TEXT = (
    "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "Arise, fair sun, and kill the envious moon, Who is already sick and pale with grief, 1597!\n"
)
T = 48


@pytest.fixture(scope="module")
def run():
    return load_run(SAMPLE)


@pytest.fixture(scope="module")
def corpus(run):
    ids = corpus_ids(TEXT, text_tokenizer(run.config, run.tokenizer))
    plan = make_plan(
        ids, "romeo", run.fingerprint, T, batch_size=1, top_contexts=3, reservoir=2, context_before=4, context_after=2
    )
    return ids, plan


@pytest.fixture(scope="module")
def surveyed(run, corpus, tmp_path_factory):
    ids, plan = corpus
    out = tmp_path_factory.mktemp("survey") / "s"
    sv.run_survey(run, ids, plan, out)
    return read_survey(out)


def _bin(v: float, edges) -> int:
    return sum(1 for e in edges if v >= e)  # the documented rule, written out


def _raw_reads(run, inputs, targets):
    """Every hook value the survey uses, read plainly for one sequence (batch of 1)."""
    got: dict[str, torch.Tensor] = {}
    names = [POINTS["token_nll"].at()]
    for i in range(run.config.num_hidden_layers):
        if run.config.is_moe_layer(i):
            names += [HookNames.block(i, f"moe.{p}") for p in ("scores", "selection", "experts", "weights", "latent")]
        if run.config.is_mla_layer(i):
            names += [HookNames.block(i, "mla.q"), HookNames.block(i, "mla.k")]
        else:
            names += [HookNames.block(i, "kda.g"), HookNames.block(i, "kda.beta")]
    names += list(attnres_sites(run.config).values())
    table = {n: (lambda v, name, info: got.__setitem__(name, v.detach().clone())) for n in names}
    with torch.no_grad(), hooks(read=table):
        run.model(torch.as_tensor(inputs), targets=torch.as_tensor(targets))
    return got


def test_every_statistic_equals_a_brute_force_computation(run, corpus, surveyed):
    ids, plan = corpus
    state, layout = surveyed.state, surveyed.layout
    s = state.sums
    E, k = layout.num_experts, layout.top_k
    edges = {k_: np.asarray(v) for k_, v in surveyed.card["edges"].items()}
    assert surveyed.complete and s["tokens"][0] == plan.sequences * T and plan.sequences == 3
    want: dict[str, np.ndarray] = {name: np.zeros_like(a) for name, a in s.items()}
    items: dict[int, list] = {i: [] for i in layout.moe_layers}
    model_hits = {p: np.zeros(len(layout.model_sizes), dtype=np.int64) for p in ec.POLICIES}
    for seq in range(plan.sequences):
        window = ids[seq * T : seq * T + T + 1].astype(np.int64)
        inputs, targets = window[None, :-1], window[None, 1:]
        r = _raw_reads(run, inputs, targets)
        nll = r["token_nll"][0].double().numpy()
        want["loss.sum"] += nll
        want["loss.count"] += 1
        for t in range(T):
            want["corpus.token_counts"][inputs[0, t]] += 1
            want["corpus.class_counts"][layout.token_classes[inputs[0, t]]] += 1
        per_layer_traces = []
        for i in layout.moe_layers:
            p = f"moe.{i}."
            scores = r[HookNames.block(i, "moe.scores")][0].double().numpy()
            selection = r[HookNames.block(i, "moe.selection")][0].double().numpy()
            experts = r[HookNames.block(i, "moe.experts")][0].numpy()
            weights = r[HookNames.block(i, "moe.weights")][0].double().numpy()
            z = r[HookNames.block(i, "moe.latent")][0]
            moe = {m.layer_idx: m for m in run.model.moe_layers()}[i]
            for t in range(T):
                order = np.sort(selection[t].astype(np.float32).astype(np.float64))[::-1]
                sel32 = selection[t].astype(np.float32)
                kth, k1 = np.sort(sel32)[::-1][k - 1], np.sort(sel32)[::-1][k]
                want[p + "margin_hist"][_bin(float(kth) - float(k1), edges["margin"])] += 1
                assert order.size == E
                for e in range(E):
                    chosen = e in experts[t]
                    score = float(scores[t, e])
                    want[p + ("chosen_hist" if chosen else "unchosen_hist")][e, _bin(score, edges["score"])] += 1
                    want[p + "cutoff_hist"][e, _bin(float(k1) - score, edges["gap"])] += 1
                for j, e in enumerate(experts[t]):
                    want[p + "load"][e] += 1
                    want[p + "gate_mass"][e] += weights[t, j]
                    with torch.no_grad():
                        norm = float(moe.experts.expert(int(e), z[t : t + 1]).float().norm())
                    want[p + "saliency_sum"][e] += weights[t, j] * norm
                    want[p + "class_counts"][e, layout.token_classes[inputs[0, t]]] += 1
                    want[p + "token_counts"][e, inputs[0, t]] += 1
                    position = seq * T + t
                    items[i].append((e, float(weights[t, j]), position))
                    for f in experts[t]:
                        want[p + "coactivation"][e, f] += 1
            trace = experts.reshape(-1).tolist()
            for policy in ec.POLICIES:
                want[p + f"cache_{policy}"] += [ec.simulate_cache(trace, c, policy) for c in layout.layer_sizes]
            for key, d in zip(trace, ec.reuse_distances(trace)):
                want[p + "reuse_hist"][key, d + 1] += 1
            want[p + "accesses"] += len(trace)
            # batches of one sequence: the batch's and the sequence's MaxVio are this sequence's load's (max/mean - 1)
            vio = moe_load_stats(np.bincount(experts.reshape(-1), minlength=E))["max_vio"]
            for scope in ("batch", "sequence"):
                want[p + f"maxvio_{scope}"] += [1, vio, vio * vio]
                want[p + f"maxvio_{scope}_hist"][_bin(vio, edges["maxvio"])] += 1
            per_layer_traces.append(experts)
        model_trace = ec.access_trace(np.stack(per_layer_traces), E).tolist()
        for policy in ec.POLICIES:
            model_hits[policy] += [ec.simulate_cache(model_trace, c, policy) for c in layout.model_sizes]
        for i in layout.kda_layers:
            g = r[HookNames.block(i, "kda.g")][0].numpy()  # [T, H, C]
            beta = r[HookNames.block(i, "kda.beta")][0].numpy()
            for h in range(layout.kda_heads):
                for v in g[:, h].ravel():
                    want[f"kda.{i}.kda_g_hist"][h, _bin(float(v), edges["kda_g"])] += 1
                for v in beta[:, h]:
                    want[f"kda.{i}.beta_hist"][h, _bin(float(v), edges["beta"])] += 1
                want[f"kda.{i}.kda_g_sum"][h] += g[:, h].astype(np.float64).sum()
                want[f"kda.{i}.beta_sum"][h] += beta[:, h].astype(np.float64).sum()
            want[f"kda.{i}.count"] += T
        for i in layout.mla_layers:
            q, kk = r[HookNames.block(i, "mla.q")][0].double(), r[HookNames.block(i, "mla.k")][0].double()
            scale = run.model.model.layers[i].self_attn.scale
            a = torch.softmax(
                (q @ kk.transpose(-1, -2) * scale).masked_fill(~torch.ones(T, T).tril().bool(), -torch.inf), -1
            )
            a = a.numpy()  # [H, T, T], full: the survey never builds it
            for h in range(layout.mla_heads):
                for row in range(T):
                    pr = a[h, row, : row + 1]
                    ent = float(-(pr[pr > 0] * np.log(pr[pr > 0])).sum())
                    if row > 0:
                        norm = ent / np.log(row + 1)
                        want[f"mla.{i}.entropy_hist"][h, _bin(norm, edges["entropy"])] += 1
                        want[f"mla.{i}.sink_hist"][h, _bin(float(pr[0]), edges["sink"])] += 1
                        want[f"mla.{i}.entropy_by_position"][h, row] += norm
                    want[f"mla.{i}.sink_by_position"][h, row] += pr[0]
            want[f"mla.{i}.rows"] += 1
        for site, point in attnres_sites(run.config).items():
            w = r[point][0].double().numpy()
            want[f"attnres.{site}.sum"] += w.sum(0)
            want[f"attnres.{site}.sumsq"] += (w * w).sum(0)
            want[f"attnres.{site}.count"] += T
    for policy in ec.POLICIES:
        want[f"cache.model_{policy}"] = model_hits[policy]
    want["cache.model_accesses"] += len(model_trace) * plan.sequences
    want["tokens"] += plan.sequences * T
    want["sequences"] += plan.sequences
    # histograms rebuilt from fp32 values that the survey bins in float64 from the same fp32: exact; MLA and
    # the expert output norms are recomputed here in fp64 / one token at a time: within tolerance, and the bins
    # of a value on an edge could differ, so those are compared up to one count per bin
    approx = ("gate_mass", "saliency_sum", "_sum", "sumsq", "loss.sum", "by_position")
    for name, got in s.items():
        if name.startswith("mla.") and name.endswith("_hist"):
            assert np.abs(got - want[name]).max() <= 1 and got.sum() == want[name].sum(), name
        elif any(a in name for a in approx):
            np.testing.assert_allclose(got, want[name], rtol=2e-4, atol=1e-4, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want[name], err_msg=name)
    for i in layout.moe_layers:
        top = state.tops[f"moe.{i}.top_contexts"]
        res = state.tops[f"moe.{i}.reservoir"]
        for e in range(E):
            mine = [(w, pos) for ee, w, pos in items[i] if ee == e]
            best = sorted(mine, key=lambda x: (-x[0], x[1]))[: plan.top_contexts]
            assert set(top.id[e][top.id[e] >= 0].tolist()) == {pos for _, pos in best}
            keys = uniform_hash(
                plan.seed, np.array([pos * E * (max(layout.moe_layers) + 1) + i * E + e for _, pos in mine])
            )
            sample = sorted(zip(-keys, [pos for _, pos in mine]))[: plan.reservoir]
            assert set(res.id[e][res.id[e] >= 0].tolist()) == {pos for _, pos in sample}
            for slot, pos in enumerate(top.id[e]):
                if pos >= 0:  # the context window with the token at column context_before
                    ctx = top.payload[e, slot]
                    assert ctx[plan.context_before] == ids[pos]
                    seq_start = (pos // T) * T
                    for c, tok in enumerate(ctx):
                        at = pos - plan.context_before + c
                        assert tok == (ids[at] if seq_start <= at < seq_start + T else -1)


def test_interrupted_survey_continues_to_the_same_state(run, corpus, surveyed, tmp_path):
    ids, plan = corpus
    out = tmp_path / "s"
    with pytest.raises(sv.SurveyStopped):
        sv.run_survey(run, ids, plan, out, progress=lambda done, total: done < 2, save_every=1)
    half = read_survey(out)
    assert not half.complete and half.state.done == {0, 1}
    sv.run_survey(run, ids, plan, out)
    again = read_survey(out)
    assert again.complete
    for name, a in surveyed.state.sums.items():
        np.testing.assert_array_equal(again.state.sums[name], a, err_msg=name)
    for name, t in surveyed.state.tops.items():
        assert (again.state.tops[name].id == t.id).all() and (again.state.tops[name].payload == t.payload).all()
    other = make_plan(ids, "romeo", run.fingerprint, T + 1, batch_size=1)
    with pytest.raises(SurveyError, match="another plan"):
        sv.run_survey(run, ids, other, out)


def test_merging_split_states_equals_the_whole(run, corpus, surveyed):
    ids, plan = corpus
    layout = surveyed.layout
    parts = []
    for rank in range(2):
        st = SurveyState(layout, plan)
        for b in range(rank, plan.batches, 2):
            inputs, targets, _ = batch_ids(ids, plan, b)
            st.add_batch(b, inputs, sv.survey_batch(run, inputs, targets, layout))
        parts.append(sv.state_from_bytes(sv.state_bytes(st), layout, plan))
    merged = SurveyState(layout, plan).merge(parts[1]).merge(parts[0])
    for name, a in surveyed.state.sums.items():
        np.testing.assert_allclose(merged.sums[name], a, rtol=1e-12, err_msg=name)
        if a.dtype.kind == "i":
            np.testing.assert_array_equal(merged.sums[name], a, err_msg=name)
    for name, t in surveyed.state.tops.items():
        assert (merged.tops[name].id == t.id).all(), name
    with pytest.raises(SurveyError, match="both states"):
        merged.merge(parts[0])


def test_hostile_survey_folders_are_refused(surveyed, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(surveyed.path, bad)
    card = json.loads((bad / CARD_NAME).read_text())
    card["arrays"]["tokens"] = ["int64", [2]]
    (bad / CARD_NAME).write_text(json.dumps(card))
    with pytest.raises(SurveyError, match="do not match"):
        read_survey(bad)
    card["arrays"]["tokens"] = ["int64", [1]]
    card["layout"]["num_experts"] = 60_000  # within the count bound, but its state would be terabytes
    (bad / CARD_NAME).write_text(json.dumps(card))
    with pytest.raises(SurveyError, match="out of range"):
        read_survey(bad)
    card["layout"]["num_experts"] = 10**9
    (bad / CARD_NAME).write_text(json.dumps(card))
    with pytest.raises(SurveyError, match="out of range"):
        read_survey(bad)
    shutil.copy(surveyed.path / CARD_NAME, bad / CARD_NAME)
    np.savez(bad / STATE_NAME, tokens=np.array([object()], dtype=object))
    with pytest.raises(SurveyError):
        read_survey(bad)
    (bad / STATE_NAME).write_bytes(b"not a zip")
    with pytest.raises(SurveyError, match="not readable"):
        read_survey(bad)
    with pytest.raises(SurveyError, match="not a survey folder"):
        read_survey(tmp_path / "missing")


def test_a_streamed_runs_observed_hits_equal_its_lru_simulation(corpus, tmp_path):
    ids, _ = corpus
    plan = make_plan(ids[:49], "romeo", "x", 4, batch_size=1)  # 4 tokens a forward: 2..8 experts per layer
    streamed = load_run(SAMPLE, max_memory="560MB")
    store = streamed.model.loading.streaming.store
    store.budget = 40 * 30720  # 40 of the 56 experts: hits and misses both happen
    sv.run_survey(streamed, ids, plan, tmp_path / "s")
    check = read_survey(tmp_path / "s").card["run"]["streamed"]
    assert check["capacity_experts"] == 40 and check["accesses"] > 7 * 2 * plan.sequences
    assert 0 < check["observed_hits"] == check["simulated_lru_hits"] < check["accesses"]
    assert check["observed_hits"] <= store.stats.hits  # the store also served the layout's 2-token probe forward


def test_maxvio_at_three_scopes(surveyed, corpus):
    """MaxVio global / per batch / per sequence (analysis.survey.tables.maxvio_table): on the survey of batches of one
    sequence the batch and sequence scopes agree and count every sequence; on sums set by hand to known values the
    mean, sd and percentiles are the known ones; the survey view draws the three scopes."""
    import copy

    from analysis.figures import survey as survey_figures
    from analysis.runs.context import AnalysisContext
    from analysis.survey.state import EDGES
    from analysis.survey.tables import maxvio_table

    _, plan = corpus
    layer = surveyed.layout.moe_layers[0]
    table = maxvio_table(surveyed).set_index(["layer", "scope"])
    s = surveyed.state.sums
    assert table.loc[(layer, "global"), "max_vio"] == moe_load_stats(s[f"moe.{layer}.load"])["max_vio"]
    assert table.loc[(layer, "batch"), "count"] == table.loc[(layer, "sequence"), "count"] == plan.sequences
    assert table.loc[(layer, "batch"), "max_vio"] == pytest.approx(table.loc[(layer, "sequence"), "max_vio"])
    known = copy.copy(surveyed)
    known.state = copy.deepcopy(surveyed.state)
    edges = EDGES["maxvio"]
    hist = np.zeros(len(edges) + 1, dtype=np.int64)
    for v in (0.25, 0.25, 0.75, 0.75):  # mean 0.5, sd 0.5; half at or below 0.3, all at or below 0.8
        hist[int(np.searchsorted(edges, v, side="right"))] += 1
    known.state.sums[f"moe.{layer}.maxvio_sequence"] = np.array([4.0, 2.0, 1.25])
    known.state.sums[f"moe.{layer}.maxvio_sequence_hist"] = hist
    row = maxvio_table(known).set_index(["layer", "scope"]).loc[(layer, "sequence")]
    assert row["max_vio"] == 0.5 and row["std"] == pytest.approx(0.25) and row["count"] == 4
    assert row["p50"] == pytest.approx(0.3) and row["p90"] == pytest.approx(0.8)
    ctx = AnalysisContext(trace=None, config=None, label="survey", options={"survey": surveyed})
    fig, df = survey_figures.maxvio_scopes(ctx)
    assert {t.name for t in fig.data} >= {"global", "per batch (mean, sd)", "per sequence (mean, sd)"}
    assert "arXiv 2408.15664" in fig.layout.title.text
