"""The benchmark suite's pieces at tiny sizes, gpu_check on the CPU, and the KDA trace state norms."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_cache, bench_forward, bench_moe, gpu_check, run_all
from benchmarks.bench_decode import generate_uncached
from benchmarks.common import Row, side_by_side
from k3core.generation import decode
from k3core.generation.decode import generate
from k3core.interp.recorder import record
from k3core.modeling.cache import K3Cache
from k3core.modeling.layers.kda import l2_norm
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from k3core.ops.kda import kda_recurrent
from tests.conftest import nano_model


@pytest.fixture(autouse=True)
def _threads():
    """gpu_check and run_all set the thread count; put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_gpu_check_runs_on_cpu_with_the_tiny_preset(capsys):
    report = gpu_check.main(["--tokens", "32", "--kda-len", "40", "--moe-tokens", "16", "--decode-steps", "3"])
    assert report["preset"] == "k3-nano" and report["device"] == "cpu"
    assert report["ok"]
    assert report["tokens_per_s"] > 0 and 0 < report["mfu"] < 1
    assert report["kda"]["rel_err"] < 1e-4 and report["decode"]["rel_err"] < 1e-4
    assert report["moe"]["grouped_mm"] is False
    out = capsys.readouterr().out
    for step in ("build", "forward", "kda", "moe", "decode", "all checks passed"):
        assert step in out


def test_side_by_side_runs_each_function_warmup_plus_repeat_times():
    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    best = side_by_side({"a": lambda: bump("a"), "b": lambda: bump("b")}, repeat=3, warmup=2)
    assert calls == {"a": 5, "b": 5}
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())
    with pytest.raises(ValueError, match="repeat"):
        side_by_side({"a": lambda: None}, repeat=0)


def test_flop_count_matches_published_active_size_and_attention_term():
    flops = bench_forward.forward_flops_per_token("kimi-k3", 4096)
    # matmuls = 2 * active weights; Kimi K3 has about 104B active parameters (reference, section 1)
    assert 2 * 100e9 < flops["matmul"] < 2 * 108e9
    cfg = from_preset("k3-small")
    a, b = (bench_forward.forward_flops_per_token(cfg, T) for T in (511, 1023))
    assert b["mla_attention"] - a["mla_attention"] == 3 * 6 * (96 + 128) * 512  # 3 MLA layers, 6 heads
    assert a["kda_chunked"] == b["kda_chunked"] == 9 * 6 * (8 * 64 * 128 + 6 * 128**2 + 2 * 64**2 / 3)


def test_baseline_matches_width_depth_and_active_ffn_weights():
    k3 = K3ForCausalLM.from_config("k3-mini", device="meta")
    base = bench_forward.baseline_for("k3-mini")
    D = k3.config.hidden_size
    assert len(base.blocks) == k3.config.num_hidden_layers and base.embed.embedding_dim == D
    for i, block in enumerate(base.blocks):
        assert abs(3 * D * block.gate.out_features - bench_forward.ffn_active_weights(k3, i)) <= 3 * D * 32
    ids = torch.randint(0, 256, (2, 9))
    assert base(ids).shape == (2, 9, 256)


def test_moe_benchmark_problem_dispatches_agree():
    ex, z, experts, weights = bench_moe.make_dispatch_problem(50, 8, 3, L=16, m=24)
    assert torch.allclose(weights.sum(-1), torch.ones(50))
    with torch.no_grad():
        torch.testing.assert_close(ex(z, experts, weights), ex.forward_masked_loop(z, experts, weights))


def test_uncached_decode_baseline_equals_cached_generate():
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config("k3-nano").eval()
    ids = torch.randint(0, 256, (1, 6))
    assert torch.equal(generate_uncached(model, ids, 5), generate(model, ids, 5))


def test_cache_rows_measure_allocated_bytes():
    rows = bench_cache.cache_rows("k3-small", "meta", lengths=(4096, 131072))
    assert [r.ok for r in rows] == [None, True]
    assert rows[0].ratio > rows[1].ratio  # the MLA share grows with length
    assert rows[1].value == decode.decode_cache_bytes("k3-small", 131072)


def test_table_and_readme_update(tmp_path):
    rows = [
        Row("b", "c", 2.0, "new", 4.0, "old", "tok/s", 0.5, "<= 1", True, "n"),
        Row("b", "d", float("nan"), "x", float("nan"), "y", "tok/s", float("nan")),
    ]
    text = run_all.table(rows)
    assert "<= 1 ok" in text and "n/a" in text
    md = run_all.table(rows, markdown=True)
    assert md.splitlines()[0].startswith("| benchmark") and md.count("\n") == 3
    path = tmp_path / "README.md"
    path.write_text(f"# B\n\nintro\n\n{run_all.START}\nold\n{run_all.END}\n\ntail\n")
    run_all.update_readme("NEW", path)
    assert path.read_text() == f"# B\n\nintro\n\n{run_all.START}\nNEW\n{run_all.END}\n\ntail\n"
    bare = tmp_path / "R2.md"
    bare.write_text("# B\n")
    run_all.update_readme("X", bare)
    assert f"{run_all.START}\nX\n{run_all.END}" in bare.read_text()


def test_suite_cli_runs_one_suite(capsys):
    rows = run_all.main(["--only", "cache", "--quick"])
    assert {r.bench for r in rows} == {"decode cache bytes"}
    assert all(r.ok for r in rows if r.ok is not None)
    out = capsys.readouterr().out
    assert "command: python -m benchmarks --only cache --quick" in out and "all-MLA" in out


def test_trace_state_norms_match_a_recurrent_reference():
    """kda.i.state_norm (the forward's chunk-end states) equals ||S|| at chunk ends of the token-by-token recurrence."""
    model = nano_model(0, kda_chunk_size=8)
    cfg = model.config
    layer = model.model.layers[1].self_attn
    seen = {}
    hook = layer.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0]) and None)
    ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad(), record(model, what=("kda",), max_batch=2) as trace:
        model(ids)
    hook.remove()
    x = seen["x"]
    B, T, _ = x.shape
    H, d = layer.num_heads, layer.head_dim
    with torch.no_grad():
        q = l2_norm(layer.q_conv1d(layer.q_proj(x))[0].view(B, T, H, d))
        k = l2_norm(layer.k_conv1d(layer.k_proj(x))[0].view(B, T, H, d))
        v = layer.v_conv1d(layer.v_proj(x))[0].view(B, T, H, d)
        beta, g = torch.sigmoid(layer.b_proj(x)), layer.decay(x)
        want, state = [], None
        for s in range(0, T, 8):
            sl = slice(s, s + 8)
            _, state = kda_recurrent(
                q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state, output_final_state=True
            )
            want.append(state.flatten(-2).norm(dim=-1))
    got = torch.from_numpy(trace["blocks.1.kda.chunk_state.norm"])
    assert trace["blocks.1.kda.chunk_state.token"].tolist() == [8, 16, 21]
    torch.testing.assert_close(got, torch.stack(want, 1), atol=1e-5, rtol=1e-5)
    # With a cache, the norms continue from the cached state.
    cache = K3Cache.for_config(cfg)
    with torch.no_grad():
        model(ids[:, :16], cache=cache)
        with record(model, what=("kda",), max_batch=2) as trace2:
            model(ids[:, 16:], cache=cache)
    torch.testing.assert_close(
        torch.from_numpy(trace2["blocks.1.kda.chunk_state.norm"])[:, -1], want[-1], atol=1e-5, rtol=1e-5
    )


def test_train_profile_attributes_forward_and_backward_to_their_parts():
    from benchmarks import train_profile

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())

        def forward(self, x):
            return self.b(self.a(x) * 2 + 1)

    toy = Toy()
    x = torch.randn(4, 8)

    def step():
        with torch.profiler.record_function("step:forward"):
            loss = toy(x).square().sum()
        with torch.profiler.record_function("step:backward"):
            loss.backward()

    parts = {toy: "toy", toy.a: "a", toy.b: "b"}
    table, total = train_profile.profile_step(step, parts)
    assert all("forward" not in m.__dict__ for m in parts)  # the scopes are taken off again
    # toy's own ops (mul, add), a's linear, b's linear + relu each go to their part, forward and backward
    assert {"toy", "a", "b", "lm head + loss"} <= set(table) and "backward (unattributed)" not in table
    for part in ("toy", "a", "b"):
        assert table[part]["ops"] >= 2 and table[part]["fwd_ms"] > 0 and table[part]["bwd_ms"] > 0
    assert 0 < sum(r["fwd_ms"] + r["bwd_ms"] for r in table.values()) <= total * 1.01


def test_train_profile_names_every_part_of_a_k3_step():
    from benchmarks import bench_train, train_profile

    k3 = K3ForCausalLM.from_config("k3-nano").train()
    opt = torch.optim.AdamW(k3.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (2, 16))
    table, total = train_profile.profile_step(
        lambda: bench_train.train_step(k3, opt, x, x, True), train_profile.k3_parts(k3), train_profile.k3_functions()
    )
    for part in ("kda_chunk", "kda projections", "kda short conv", "mla", "lm head + loss", "step:optimizer"):
        assert table[part]["ops"] > 0, part
    assert table["kda_chunk"]["bwd_ms"] > 0  # the hand-written backward node is found by its sequence number
    assert "backward (unattributed)" not in table
    text = train_profile.format_side_by_side({"K3": table, "GPT": {}}, {"K3": total, "GPT": 0.0}, {"K3": 1, "GPT": 1})
    row = next(line for line in text.splitlines() if line.startswith("kda_chunk"))
    assert f"{table['kda_chunk']['ops']:6d}" in row and "sum of parts" in text


def test_benchmarks_import_no_test_code():
    """Tests may import the benchmarks' helpers (benchmarks/k3_replica.py), never the other way round."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno}" for n in names if n == "tests" or n.startswith("tests.")]
    assert found == []
