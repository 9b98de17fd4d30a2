"""Tracing: every documented array appears with its axes, bounded, round-trips; tracing off costs nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import k3core.interp.recorder as trace_mod
from k3core.interp import trace
from k3core.interp.recorder import Recorder, record
from k3core.interp.trace import Trace
from k3core.interp.trace_npz import TraceError
from k3core.modeling.config import ATTNRES_MODES
from tests.conftest import nano_model


def documented_arrays() -> list[tuple[str, tuple[str, ...]]]:
    """(regex, axes) for every array name listed in the k3core.interp.recorder module docstring.

    ``i`` stands for a layer index; ``a|b`` alternatives apply to the last dotted component."""
    out = []
    for line in trace_mod.__doc__.splitlines():
        m = re.match(r"^ {4}([a-z_][\w.|]*)\s+\[([^\]]*)\]", line)
        if not m:
            continue
        name, axes = m.group(1), tuple(a.strip() for a in m.group(2).split(",") if a.strip())
        head, _, last = name.rpartition(".")
        for alt in last.split("|"):
            full = f"{head}.{alt}" if head else alt
            out.append(("^" + re.escape(full).replace(r"\.i\.", r"\.\d+\.") + "$", axes))
    return out


def test_docstring_lists_the_arrays():
    names = [p for p, _ in documented_arrays()]
    assert len(names) == 50  # 28 before the whole-text summaries (issue 24), 40 before KDA's implicit attention
    assert r"^blocks\.\d+\.kda\.g$" in names and r"^blocks\.\d+\.mlp_res\.bias$" in names
    assert r"^output_res\.weights$" in names


B, T = 3, 9
MAX_TOKENS, MAX_BATCH, MAX_ATTN = 5, 2, 4


def _record_all(model, ids, **kwargs):
    with torch.no_grad(), record(model, what="all", max_tokens=MAX_TOKENS, max_batch=MAX_BATCH,
                                 max_attn_len=MAX_ATTN, **kwargs) as tr:  # fmt: skip
        out = model(ids, labels=ids)
    return tr, out


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def block_trace(ids):
    model = nano_model()
    tr, out = _record_all(model, ids)
    return model, tr, out


@pytest.mark.parametrize("residual", ["block_attnres", "full_attnres", "scale_bias", "plain"])
def test_every_documented_array_appears_with_its_axes(ids, residual):
    model = nano_model(residual=residual)
    tr, _ = _record_all(model, ids)
    cfg = model.config
    for name in tr.arrays:
        assert any(re.match(p, name) for p, _ in documented_arrays()), f"undocumented array {name}"
    for pattern, axes in documented_arrays():
        hits = [n for n in tr.arrays if re.match(pattern, n)]
        expect = True
        if re.search(r"_res\\\.(weights|query_norm)", pattern):
            expect = residual in ATTNRES_MODES
        elif re.search(r"_res\\\.(scale|bias)", pattern):
            expect = residual == "scale_bias"
        assert bool(hits) == expect, (pattern, residual)
        for n in hits:
            assert tr.axes[n] == axes, n
            assert tr[n].ndim == len(axes), n
    kda = [i for i, t in enumerate(cfg.layer_types()) if t == "KDA"]
    mla = [i for i, t in enumerate(cfg.layer_types()) if t == "MLA"]
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert tr.layer_indices("kda") == kda and tr.layer_indices("mla") == mla and tr.layer_indices("moe") == moe
    for i in kda:
        assert {n.removeprefix(f"blocks.{i}.kda.") for n in tr.names(f"blocks.{i}.kda.")} == {
            "g", "g.bins", "beta", "gate.mean", "chunk_state.norm", "chunk_state.rank", "chunk_state.token",
            "state", "attn", "attn.before", "attn.entropy", "attn.sink", "attn.received", "attn.negative",
            "attn.row_sum", "attn.half_distance", "attn.distance", "attn.distance_edges"}  # fmt: skip
    if residual == "scale_bias":
        assert (
            len([n for n in tr.names("blocks.") if n.endswith(("_res.scale", "_res.bias"))])
            == 4 * cfg.num_hidden_layers
        )
    if residual in ATTNRES_MODES:
        sites = set(tr.meta["attnres_sources"])
        assert {f"{i}.mlp" for i in range(cfg.num_hidden_layers)} | {"output"} <= sites
        for site, names in tr.meta["attnres_sources"].items():
            assert tr[trace.TraceNames.attnres(site)].shape[-1] == len(names)


def test_arrays_are_bounded(block_trace, ids):
    model, tr, _ = block_trace
    limits = {"batch": MAX_BATCH, "token": MAX_TOKENS}
    attn_limits = {**limits, "query": MAX_ATTN, "key": MAX_ATTN}  # "key" elsewhere is a KDA state channel
    for name, axes in tr.axes.items():
        for axis, size in zip(axes, tr[name].shape):
            lim = attn_limits if name.startswith("mla.") else limits
            if axis in lim:
                assert size == lim[axis], (name, axis, size)
    assert tr["hidden"].shape == (model.config.num_hidden_layers + 1, MAX_BATCH, MAX_TOKENS, 64)
    np.testing.assert_array_equal(tr["tokens"], ids[:MAX_BATCH, :MAX_TOKENS].numpy())
    assert tr.meta["max_tokens"] == MAX_TOKENS and tr.meta["max_batch"] == MAX_BATCH
    assert tr.meta["layer_types"] == model.config.layer_types()


def test_recorded_values_mean_what_they_say(block_trace, ids):
    model, tr, out = block_trace
    cfg = model.config
    k, E = cfg.num_experts_per_token, cfg.num_experts
    for i in tr.layer_indices("moe"):
        assert tr[f"blocks.{i}.moe.experts.load"].sum() == B * T * k  # whole batch, not the clipped prefix
        w = tr[f"blocks.{i}.moe.weights"]
        np.testing.assert_allclose(w.sum(-1), cfg.routed_scaling_factor, rtol=1e-5)
        assert (np.diff(w, axis=-1) <= 0).all()  # sorted by weight rank
        assert ((tr[f"blocks.{i}.moe.experts"] >= 0) & (tr[f"blocks.{i}.moe.experts"] < E)).all()
        s = tr[f"blocks.{i}.moe.scores"]
        assert ((s > 0) & (s < 1)).all() and s.shape[-1] == E
        assert tr[f"blocks.{i}.moe.latent"].shape[-1] == cfg.routed_expert_hidden_size
    # kda.0.g is the decay of layer 0 on its (recorded) input
    layer0 = model.model.layers[0]
    with torch.no_grad():
        g0 = layer0.self_attn.decay(layer0.input_layernorm(torch.from_numpy(tr["hidden"][0])))
    np.testing.assert_allclose(tr["blocks.0.kda.g"], g0.numpy(), rtol=1e-5, atol=1e-6)
    beta = tr["blocks.1.kda.beta"]
    assert ((beta > 0) & (beta < 1)).all()
    np.testing.assert_array_equal(tr["blocks.0.kda.chunk_state.token"], [MAX_TOKENS])
    assert tr["blocks.0.kda.state"].shape == (MAX_BATCH, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    probs = tr["blocks.3.mla.attn"]
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(probs, 1) == 0)  # causal
    for name in tr.arrays:
        if name.endswith("_res.weights"):
            np.testing.assert_allclose(tr[name].sum(-1), 1.0, rtol=1e-5)
    # token_nll: per-token loss of the recorded prefix; the last position has no next token (NaN)
    nll = F.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:], reduction="none")
    np.testing.assert_allclose(tr["token_nll"][0, :MAX_TOKENS], nll[:MAX_TOKENS].numpy(), rtol=1e-5)
    hidden_rms = np.sqrt((tr["hidden"] ** 2).mean(-1))
    np.testing.assert_allclose(tr["hidden_rms"], hidden_rms, rtol=1e-5)


def test_last_position_nll_is_nan_when_the_prefix_covers_it(ids):
    model = nano_model()
    with torch.no_grad(), record(model, what="loss") as tr:
        model(ids, labels=ids)
    assert tr["token_nll"].shape == (1, T)
    assert np.isnan(tr["token_nll"][0, -1]) and np.isfinite(tr["token_nll"][0, :-1]).all()


def test_save_load_round_trip(block_trace, tmp_path):
    _, tr, _ = block_trace
    path = tr.save(tmp_path / "run.trace.npz")
    back = Trace.load(path)
    assert back.arrays.keys() == tr.arrays.keys()
    for name, value in tr.arrays.items():
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    assert back.axes == tr.axes
    assert back.meta == tr.meta
    assert back.config == tr.config and back.config["name"] == "k3-nano"


def test_load_rejects_garbage(tmp_path, block_trace):
    with pytest.raises(TraceError, match="no such trace"):
        Trace.load(tmp_path / "missing.npz")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(TraceError, match="garbage.npz"):
        Trace.load(garbage)
    good = block_trace[1].save(tmp_path / "good.npz").read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(TraceError):
        Trace.load(truncated)
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.arange(3))
    with pytest.raises(TraceError):
        Trace.load(plain)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, __header__=np.array([{"format": "k3lab-trace/1"}], dtype=object))
    with pytest.raises(TraceError):
        Trace.load(pickled)
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, __header__=np.frombuffer(b'{"format": "other/2", "meta": {}, "axes": {}}', dtype=np.uint8))
    with pytest.raises(TraceError, match="unknown trace format"):
        Trace.load(wrong)
    no_axes = tmp_path / "no_axes.npz"
    header = b'{"format": "k3lab-trace/1", "meta": {}, "axes": {}}'
    np.savez(no_axes, __header__=np.frombuffer(header, dtype=np.uint8), **{"a/x": np.arange(3)})
    with pytest.raises(TraceError, match="axes"):
        Trace.load(no_axes)


def test_recording_off_leaves_no_trace(ids):
    model = nano_model()
    assert trace_mod.current() is None
    with torch.no_grad(), record(model, what="moe") as tr:
        assert trace_mod.current() is not None
        model(ids)
    assert trace_mod.current() is None
    snapshot = {k: v.copy() for k, v in tr.arrays.items()}
    assert set(snapshot) == {"tokens", "position_bins"} | {n for n in snapshot if ".moe." in n}
    with torch.no_grad():
        model(ids[:, :4])
    assert tr.arrays.keys() == snapshot.keys()
    assert all(np.array_equal(tr[k], v) for k, v in snapshot.items())


def test_record_cannot_nest_and_always_resets(ids):
    model = nano_model()
    with record(model) as outer:
        with pytest.raises(RuntimeError, match="nested"):
            with record(model):
                pass
        assert trace_mod.current() is not None
        with torch.no_grad():
            model(ids)
    assert "tokens" in outer and trace_mod.current() is None
    with pytest.raises(LookupError):
        with record(model):
            raise LookupError("fails inside the block")
    assert trace_mod.current() is None
    with pytest.raises(ValueError, match="unknown trace items"):
        with record(model, what={"kda", "everything"}):
            pass
    assert trace_mod.current() is None


def test_the_last_forward_wins(ids):
    model = nano_model()
    with torch.no_grad(), record(model, what=("hidden", "kda")) as tr:
        model(ids)
        model(ids[:1, :3])
    assert tr["tokens"].shape == (1, 3) and tr["hidden"].shape[2] == 3 and tr["blocks.0.kda.g"].shape[1] == 3


def test_what_selects_items(ids):
    model = nano_model()
    with torch.no_grad(), record(model, what="kda") as tr:
        model(ids, labels=ids)
    assert {n.split(".")[0] for n in tr.arrays} == {"tokens", "position_bins", "blocks"}
    assert {n.split(".")[2] for n in tr.arrays if n.startswith("blocks.")} == {"kda"}


@pytest.mark.parametrize("residual", ["block_attnres", "full_attnres", "scale_bias", "plain"])
def test_tracing_off_never_calls_recorder_code(monkeypatch, ids, residual):
    """With no recorder active the forward and backward never touch Recorder or Trace (full speed)."""

    def boom(*args, **kwargs):
        raise AssertionError("recorder code ran with tracing off")

    for name in ("put", "put_tokens", "hidden", "start_forward", "wants", "clip", "finish", "__init__"):
        monkeypatch.setattr(Recorder, name, boom)
    monkeypatch.setattr(Trace, "add", boom)
    model = nano_model(residual=residual, balancing="aux_loss").train()
    out = model(ids, labels=ids)
    (out.loss + out.aux_loss).backward()
    with torch.no_grad():
        model.eval()(ids)
    with pytest.raises(AssertionError, match="recorder code ran"):  # the patches are live
        with record(model):
            pass


def test_every_trace_name_builder_matches_a_documented_array():
    """TraceNames builds exactly the names the docstring documents, and covers every documented one."""
    N = trace.TraceNames
    built = [
        N.TOKENS,
        N.TOKEN_NLL,
        N.HIDDEN,
        N.HIDDEN_RMS,
        N.attnres(N.OUTPUT_SITE),
        N.attnres_query_norm(N.OUTPUT_SITE),
    ]
    moments = ("count", "sum", "unit_sum", "gram", "cross_gram", "cos_sum")
    built += [N.POSITION_BINS] + [N.hidden_bins(k) for k in moments]
    built += [N.mla_stat(3, k) for k in ("entropy", "sink", "received")] + [N.kda_state_rank(3), N.kda_g_bins(3)]
    kda_attn = ("entropy", "sink", "received", "negative", "row_sum", "half_distance", "distance", "distance_edges")
    built += [N.kda_attn(3)] + [N.kda_attn_stat(3, k) for k in (*kda_attn, "before")]
    built += [f(3) for f in (N.kda_g, N.kda_beta, N.kda_gate, N.kda_state_norm, N.kda_state_steps,
                             N.kda_final_state, N.mla_attn, N.mla_gate, N.moe_scores, N.moe_experts,
                             N.moe_weights, N.moe_latent, N.moe_load, N.moe_bias)]  # fmt: skip
    for side in ("attn", "mlp"):
        site = N.attnres_site(3, side)
        built += [N.attnres(site), N.attnres_query_norm(site)]
        built += [N.residual(3, side, kind) for kind in ("scale", "bias")]
    assert N.attnres(N.OUTPUT_SITE) == "output_res.weights"
    assert N.attnres_query_norm(N.OUTPUT_SITE) == "output_res.query_norm"
    assert N.kda_g(12) == "blocks.12.kda.g" and N.moe_load(0) == "blocks.0.moe.experts.load"
    assert N.residual(1, "mlp", "bias") == "blocks.1.mlp_res.bias"
    patterns = [p for p, _ in documented_arrays()]
    assert len(set(built)) == len(built) == len(patterns)
    for name in built:
        assert sum(bool(re.match(p, name)) for p in patterns) == 1, name
    assert (
        N.attnres_site_of("blocks.3.mlp_res.weights") == "3.mlp" and N.attnres_site_of("output_res.weights") == "output"
    )
    assert N.attnres_site_of("blocks.3.mlp_res.query_norm") is None and N.attnres_site_of("blocks.3.kda.g") is None
    with pytest.raises(ValueError, match="attn"):
        N.attnres_site(0, "ffn")
    with pytest.raises(ValueError, match="scale"):
        N.residual(0, "attn", "gain")


def test_two_threads_record_their_own_models_at_the_same_time(ids):
    """The recorder is per thread/context: two concurrent record() blocks each get their own full trace."""
    import threading

    models = {"block": nano_model(residual="block_attnres"), "plain": nano_model(residual="plain")}
    inputs = {"block": ids[:2, :7], "plain": ids[1:, :5]}
    inside = threading.Barrier(2, timeout=60)
    traces, errors = {}, []

    def work(key):
        try:
            model = models[key]
            with torch.no_grad(), record(model, what="all") as tr:
                inside.wait()  # both recorders are now active at once
                model(inputs[key], labels=inputs[key])
                inside.wait()  # both forwards finished while both recorders were active
            traces[key] = tr
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert trace_mod.current() is None
    for key, model in models.items():
        tr, x = traces[key], inputs[key]
        np.testing.assert_array_equal(tr["tokens"], x[:1].numpy())
        assert tr.meta["config"]["residual"] == model.config.residual
        with torch.no_grad(), record(model, what="all") as alone:
            model(x, labels=x)
        assert alone.arrays.keys() == tr.arrays.keys(), key
        for name in alone.arrays:
            np.testing.assert_allclose(tr[name], alone[name], rtol=1e-5, atol=1e-6, err_msg=f"{key} {name}")
    assert any(n.endswith("_res.weights") for n in traces["block"].arrays)
    assert not any(n.endswith("_res.weights") for n in traces["plain"].arrays)
