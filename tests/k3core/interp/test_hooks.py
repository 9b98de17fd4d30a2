"""Hook points (k3core.interp.hooks): every documented point fires with its axes, writes replace values, an empty
context changes nothing, and the layers hold computation only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from k3core.interp import hooks as hooks_mod
from k3core.interp.hooks import POINT_AXES, HookNames, hook_points, hooks
from tests.conftest import nano_model, random_ids

RESIDUALS = ["block_attnres", "full_attnres", "scale_bias", "plain"]


def _fired(model, ids):
    """{point: [shape per call]} of one forward that reads every point (and writes the key masks as they are,
    the only point offered to writers only)."""
    seen: dict[str, list[tuple[int, ...]]] = {}

    def look(value, name, info):
        seen.setdefault(name, []).append(tuple(value.shape))

    points = hook_points(model.config)
    masks = {n: (lambda v, name, info: v) for n in points if n.endswith("mla.key_mask")}
    with torch.no_grad(), hooks(read=dict.fromkeys(points, look), write=masks):
        model(ids, labels=ids)
    return seen


@pytest.mark.parametrize("residual", RESIDUALS)
def test_every_listed_point_fires_once_with_its_axes(residual):
    model = nano_model(residual=residual)
    ids = random_ids(11, 2)
    seen = _fired(model, ids)
    points = hook_points(model.config)
    assert set(seen) == set(points)
    chunks = -(-11 // model.config.kda_chunk_size)  # 2: the chunk-end state fires once per chunk
    assert chunks == 2
    assert all(len(seen[n]) == (chunks if n.endswith("kda.chunk_state") else 1) for n in points)
    for name, shapes in seen.items():
        axes = hooks_mod.point_axes(name)
        assert len(shapes[0]) == len(axes), (name, axes, shapes)
        if axes[:3] == ("batch", "token", "hidden"):
            assert shapes[0] == (2, 11, 64), name
    sources = seen["final_stream"][0][0]
    assert sources == {"plain": 1, "scale_bias": 1, "full_attnres": 9, "block_attnres": 3}[residual]


def test_module_docstring_lists_every_point_kind():
    documented = set()
    for line in hooks_mod.__doc__.splitlines():
        m = re.match(r"^ {4}([a-z_][\w.|]*)\s+\[", line)
        if m:
            head, _, last = m.group(1).replace("blocks.i.", "").rpartition(".")
            documented |= {f"{head}.{alt}" if head else alt for alt in last.split("|")}
    assert documented == set(POINT_AXES)


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
    layers = Path(__file__).resolve().parents[3] / "k3core" / "layers"
    for path in layers.glob("*.py"):
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
