"""Hook points (k3core.modeling.hooks, declared in the modules that produce them, collected by
k3core.interp.catalogue): every declared point fires with its axes and nothing undeclared fires, the docs table is
the declarations', the module docstring's example runs, writes replace values, an empty context changes nothing,
and the layers hold computation only."""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import pytest
import torch

from k3core.interp import catalogue
from k3core.interp.catalogue import hook_points
from k3core.modeling import hooks as hooks_mod
from k3core.modeling.hooks import HookContext, HookNames, hooks
from tests.conftest import nano_model, random_ids

ROOT = Path(__file__).resolve().parents[3]
RESIDUALS = ["block_attnres", "full_attnres", "scale_bias", "plain"]


def _fired(model, ids, monkeypatch):
    """({point: [shape per call]} of the declared points, every name the model passed through ``point``) of one
    forward that reads every declared point and writes each as it is (so the points offered on request, the key
    mask to writers only, are produced)."""
    seen: dict[str, list[tuple[int, ...]]] = {}
    passed: set[str] = set()
    run = HookContext.run

    def spy(self, name, value, info):
        passed.add(name)
        return run(self, name, value, info)

    def look(value, name, info):
        seen.setdefault(name, []).append(tuple(value.shape))

    monkeypatch.setattr(HookContext, "run", spy)
    points = hook_points(model.config)
    with torch.no_grad(), hooks(read=dict.fromkeys(points, look), write=dict.fromkeys(points, lambda v, n, i: None)):
        model(ids, labels=ids)
    return seen, passed


CONFIGS = [
    *({"residual": r} for r in RESIDUALS),
    {"mla_output_gate": False, "num_shared_experts": 0},  # the points a layer has only with a gate / shared experts
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_every_declared_point_fires_once_with_its_axes_and_nothing_undeclared_fires(overrides, monkeypatch):
    model = nano_model(**overrides)
    ids = random_ids(11, 2)
    seen, passed = _fired(model, ids, monkeypatch)
    points = hook_points(model.config)
    assert set(seen) == set(points)  # every declared point of this model fired
    assert passed == set(points)  # and the model passed no name that is not declared
    chunks = -(-11 // model.config.kda_chunk_size)  # 2: the chunk-end state fires once per chunk
    assert chunks == 2
    blocks = -(-11 // 1024)  # the key mask: once per query block
    for n in points:
        want = chunks if n.endswith("kda.chunk_state") else blocks if n.endswith("mla.key_mask") else 1
        assert len(seen[n]) == want, n
    for name, shapes in seen.items():
        axes = catalogue.point_axes(name)
        assert len(shapes[0]) == len(axes), (name, axes, shapes)
        if axes[:3] == ("batch", "token", "hidden"):
            assert shapes[0] == (2, 11, 64), name
    if "residual" in overrides:
        sources = seen["final_stream"][0][0]
        assert sources == {"plain": 1, "scale_bias": 1, "full_attnres": 9, "block_attnres": 3}[overrides["residual"]]


def test_every_declared_point_is_offered_by_some_model():
    """A declaration no configuration uses is dead: every one is in hook_points of one of the configs above."""
    offered = set()
    for overrides in CONFIGS:
        offered |= {HookNames.point_of(n) for n in hook_points(nano_model(**overrides).config)}
    assert offered == set(catalogue.POINTS)


def test_a_point_nobody_declared_is_caught(monkeypatch):
    """The check above sees a name the model passes without declaring it."""
    model = nano_model()
    real = model.model.layers[0].feed_forward

    def feed_forward(h):
        return hooks_mod.point(hooks_mod.active(), "blocks.0.undeclared", real(h))

    monkeypatch.setattr(model.model.layers[0], "feed_forward", feed_forward)
    _, passed = _fired(model, random_ids(5, 1), monkeypatch)
    assert passed - set(hook_points(model.config)) == {"blocks.0.undeclared"}


def test_the_docs_table_is_the_declarations():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    begin, end = "<!-- hook points: begin -->", "<!-- hook points: end -->"
    assert begin in text and end in text, "docs/ARCHITECTURE.md has no generated hook point table"
    table = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == catalogue.points_table(), "regenerate with k3core.interp.catalogue.points_table()"
    assert "`blocks.i.kda.chunk_state`" in table and "`logits`" in table


def test_the_module_docstring_example_runs():
    result = doctest.testmod(hooks_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("residual", RESIDUALS)
def test_an_empty_context_and_identity_writes_leave_logits_bitwise_equal(residual):
    model = nano_model(residual=residual)
    ids = random_ids(13, 2)
    with torch.no_grad():
        plain = model(ids).logits
        with hooks():
            empty = model(ids).logits
        keep = {n: (lambda v, name, info: v) for n in hook_points(model.config) if HookNames.point_of(n) != "key_mask"}
        with hooks(write=keep):
            same = model(ids).logits
    assert torch.equal(plain, empty) and torch.equal(plain, same)


def test_a_write_replaces_the_value_and_contexts_nest():
    model = nano_model()
    ids = random_ids(9, 1)
    name = HookNames.block(2, "mixer_out")
    seen = []
    with torch.no_grad():
        with model.model.layers[2].self_attn.register_forward_hook(lambda m, i, o: torch.zeros_like(o)):
            want = model(ids).logits
        with hooks(write={name: lambda v, n, info: torch.zeros_like(v)}):
            with hooks(read={name: lambda v, n, info: seen.append(v.abs().max().item())}):
                got = model(ids).logits
            assert hooks_mod.active() is not None
        assert hooks_mod.active() is None
    assert torch.equal(got, want) and seen == [0.0]


def test_a_stream_write_replaces_every_source():
    model = nano_model(residual="full_attnres")
    ids = random_ids(7, 1)
    name = HookNames.block(2, "stream")
    got = {}
    with (
        torch.no_grad(),
        hooks(
            write={name: lambda v, n, info: torch.zeros_like(v)},
            read={HookNames.block(2, "resid_in"): lambda v, n, info: got.setdefault("h", v)},
        ),
    ):
        model(ids)
    assert torch.count_nonzero(got["h"]) == 0


def test_layers_import_no_tracing_and_hold_no_diagnostics():
    layers = sorted((Path(__file__).resolve().parents[3] / "k3core" / "modeling" / "layers").glob("*.py"))
    assert len(layers) >= 6  # the layers were found
    for path in layers:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert "trace" not in (node.module or ""), path
                assert all("trace" not in a.name for a in node.names), path
            if isinstance(node, ast.Import):
                assert all("trace" not in a.name for a in node.names), path
        text = path.read_text()
        for diagnostic in ("state_norm", "put_tokens", "_record", ".softmax(", "torch.softmax", "chunk_end"):
            assert diagnostic not in text, (path.name, diagnostic)


def test_an_attnres_site_is_a_value_written_and_read_in_one_place():
    from k3core.modeling.hooks import AttnResSite, HookNames

    for text, site in (("3.attn", AttnResSite(3, "attn")), ("0.mlp", AttnResSite(0, "mlp")),
                       ("output", AttnResSite(None, "output"))):  # fmt: skip
        assert AttnResSite.parse(text) == site and str(site) == text
        for what in ("weights", "mix", "query_norm"):
            name = site.point(what)
            assert AttnResSite.of_point(name) == site and HookNames.attnres_point(text, what) == name
    assert AttnResSite(3, "mlp").point("weights") == "blocks.3.mlp_res.weights"
    assert AttnResSite.of_point("blocks.3.kda.g") is None
    for bad in ("3", "x.attn", "3.ffn", "-1.attn", ""):
        with pytest.raises(ValueError):
            AttnResSite.parse(bad)
    with pytest.raises(ValueError):
        AttnResSite(None, "attn")


def test_a_compiled_forward_sees_no_hook_context_and_the_eager_one_does():
    """Inside torch.compile active() is None (a ContextVar read broke Dynamo's graph at every module); the eager
    call of the same function inside the same context still sees its hooks."""

    def depth_of_context(x: torch.Tensor) -> torch.Tensor:
        return x + (0.0 if hooks_mod.active() is None else 1.0)

    compiled = torch.compile(depth_of_context, backend="eager", fullgraph=True)
    x = torch.zeros(2)
    with hooks(read={"logits": lambda value, name, info: None}):
        assert torch.equal(depth_of_context(x), torch.ones(2))
        assert torch.equal(compiled(x), torch.zeros(2))
