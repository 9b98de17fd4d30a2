"""Tests for k3core.ops.kda: recurrent reference, decode step and chunked KDA (CPU, fast)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import pathlib
import sys
import sysconfig
import types

import pytest
import torch
import torch.nn.functional as F

from k3core.ops import kda_chunk, kda_recurrent, kda_step


def make_inputs(B, T, H, K, V, *, HV=None, g_mode="uniform", dtype=torch.float32, seed=0, h0=False):
    """Random KDA inputs: unit q/k, log-decay g <= 0, beta in (0, 1)."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    if g_mode == "uniform":  # uniform in (-5, 0): the K3 gate range
        g = -5.0 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64)
    elif g_mode == "slow":  # weak decay: long memory, the delta rule does the forgetting
        g = -0.05 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64)
    elif g_mode == "lower_bound":  # every step at the K3 lower bound
        g = torch.full((B, T, HV, K), -5.0, dtype=torch.float64)
    elif g_mode == "extreme":  # far below any bound (Kimi Linear's softplus gate is unbounded)
        g = -50.0 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64)
    else:
        raise ValueError(g_mode)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    out = [t.to(dtype) for t in (q, k, v, g, beta)]
    if h0:
        out.append(torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64).to(dtype))
    return out


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


# ----------------------------------------------------------------------------------------------
# the recurrence itself
# ----------------------------------------------------------------------------------------------


def naive_kda_from_equations(q, k, v, g, beta, scale, h0):
    """S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T ; o_t = S_t^T (scale q_t).

    Deliberately literal: explicit identity matrices, Python loops over batch, head and time.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    final = torch.zeros(B, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = h0[b, h].double().clone() if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t in range(T):
                kt = k[b, t, h].double().reshape(K, 1)
                vt = v[b, t, h].double().reshape(V, 1)
                bt = beta[b, t, h].double()
                decay = torch.diag(torch.exp(g[b, t, h].double()))
                S = (eye - bt * kt @ kt.T) @ decay @ S + bt * kt @ vt.T
                o[b, t, h] = S.T @ (scale * q[b, t, h].double())
            final[b, h] = S
    return o, final


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_matches_equations(with_h0, dtype):
    q, k, v, g, beta, h0 = make_inputs(2, 9, 3, 5, 4, dtype=dtype, h0=True, seed=1)
    h0 = h0 if with_h0 else None
    scale = 0.7
    o, S = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    o_ref, S_ref = naive_kda_from_equations(q, k, v, g, beta, scale, h0)
    assert o.dtype == dtype and S.dtype == dtype
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(S.double(), S_ref, atol=1e-5, rtol=0)


def test_recurrent_defaults_and_dtypes():
    q, k, v, g, beta = make_inputs(1, 5, 2, 8, 4, dtype=torch.bfloat16)
    o, S = kda_recurrent(q, k, v, g, beta)
    assert S is None
    assert o.shape == (1, 5, 2, 4) and o.dtype == torch.bfloat16
    o2, S2 = kda_recurrent(q, k, v, g, beta, scale=8**-0.5, output_final_state=True)
    assert S2.dtype == torch.float32 and S2.shape == (1, 2, 8, 4)
    assert torch.equal(o, o2)
    o_ref, _ = naive_kda_from_equations(q, k, v, g, beta, 8**-0.5, None)
    torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=2e-2)  # bf16 output rounding


def _find_fla_naive() -> pathlib.Path | None:
    """fla/ops/kda/naive.py in the installed package, located without importing fla."""
    candidates = []
    try:
        spec = importlib.util.find_spec("fla")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) for p in spec.submodule_search_locations]
    candidates.append(pathlib.Path(sysconfig.get_paths()["purelib"]) / "fla")
    for root in candidates:
        path = root / "ops" / "kda" / "naive.py"
        if path.is_file():
            return path
    return None


def _load_fla_naive():
    path = _find_fla_naive()
    if path is None:
        pytest.skip("fla/ops/kda/naive.py not installed")
    # The file imports einops (used only by naive_chunk_kda); fla-core is installed without its
    # dependencies, so provide a placeholder for the duration of the import if it is missing.
    stub = None
    if importlib.util.find_spec("einops") is None:
        stub = types.ModuleType("einops")

        def rearrange(*args, **kwargs):
            raise NotImplementedError("einops placeholder")

        stub.rearrange = rearrange
        sys.modules["einops"] = stub
    try:
        spec = importlib.util.spec_from_file_location("_fla_kda_naive_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if stub is not None and sys.modules.get("einops") is stub:
            del sys.modules["einops"]
    fn = getattr(module, "naive_recurrent_kda", None)
    if fn is None:
        pytest.skip("naive_recurrent_kda not found in fla's naive.py")
    params = list(inspect.signature(fn).parameters)
    expected = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state"]
    if params[: len(expected)] != expected:
        pytest.skip(f"unexpected naive_recurrent_kda signature: {params}")
    return fn


@pytest.mark.parametrize("HV", [3, 6])
def test_recurrent_matches_fla_naive(HV):
    fla_naive = _load_fla_naive()
    q, k, v, g, beta, h0 = make_inputs(2, 40, 3, 16, 8, HV=HV, h0=True, seed=2)
    o_ref, S_ref = fla_naive(q, k, v, g, beta, scale=None, initial_state=h0, output_final_state=True)
    o, S = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)


def test_step_repeated_equals_recurrent():
    q, k, v, g, beta, h0 = make_inputs(2, 17, 2, 8, 6, h0=True, seed=3)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state = h0
    outs = []
    for t in range(q.shape[1]):
        o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o_t)
    torch.testing.assert_close(torch.stack(outs, dim=1), o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, S_ref, atol=1e-6, rtol=1e-6)
    # state=None means zeros
    o0, s0 = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], None)
    o0_ref, s0_ref = kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], output_final_state=True)
    torch.testing.assert_close(o0, o0_ref[:, 0])
    torch.testing.assert_close(s0, s0_ref)


# ----------------------------------------------------------------------------------------------
# chunked form against the recurrent reference
# ----------------------------------------------------------------------------------------------

RTOL_RMS = 1e-5


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_matches_recurrent(T, with_h0):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 32, 16, h0=True, seed=T)
    h0 = h0 if with_h0 else None
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert o.shape == o_ref.shape and o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= RTOL_RMS
    assert rel_rms(S, S_ref) <= RTOL_RMS


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("g_mode", ["lower_bound", "uniform", "slow", "extreme"])
def test_chunk_strong_and_weak_decay(chunk_size, g_mode):
    """g = -5 on every step (320 of cumulative decay per 64-chunk) must not overflow anywhere."""
    q, k, v, g, beta, h0 = make_inputs(1, 300, 2, 32, 32, g_mode=g_mode, h0=True, seed=4)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunk(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size, backend="torch"
    )
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o, o_ref) <= RTOL_RMS
    assert rel_rms(S, S_ref) <= RTOL_RMS


@pytest.mark.parametrize("chunk_size", [1, 2, 16, 32, 128])
def test_chunk_sizes(chunk_size):
    q, k, v, g, beta, h0 = make_inputs(2, 77, 2, 16, 8, h0=True, seed=5)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunk(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size, backend="torch"
    )
    assert rel_rms(o, o_ref) <= RTOL_RMS
    assert rel_rms(S, S_ref) <= RTOL_RMS


def test_chunk_grouped_values_and_scale():
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 16, 8, HV=4, h0=True, seed=6)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    o, S = kda_chunk(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True, backend="torch")
    assert o.shape == (2, 70, 4, 8)
    assert rel_rms(o, o_ref) <= RTOL_RMS
    assert rel_rms(S, S_ref) <= RTOL_RMS


def test_chunk_dtypes_and_defaults():
    q, k, v, g, beta = make_inputs(1, 50, 2, 16, 16, dtype=torch.bfloat16, seed=7)
    o, S = kda_chunk(q, k, v, g, beta)  # CPU: "auto" means the torch path
    assert S is None and o.dtype == torch.bfloat16 and o.is_contiguous()
    o2, S2 = kda_chunk(q, k, v, g, beta, output_final_state=True, backend="torch")
    assert S2.dtype == torch.float32
    assert torch.equal(o, o2)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, output_final_state=True)
    assert rel_rms(S2, S_ref) <= RTOL_RMS  # both computed in fp32 from the same bf16 inputs
    # fp64 in, fp64 math
    q, k, v, g, beta = make_inputs(1, 50, 2, 16, 16, dtype=torch.float64, seed=7)
    o, S = kda_chunk(q, k, v, g, beta, output_final_state=True, backend="torch")
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == S.dtype == torch.float64
    assert rel_rms(o, o_ref) <= 1e-12 and rel_rms(S, S_ref) <= 1e-12


def test_chunk_does_not_modify_inputs():
    inputs = make_inputs(1, 40, 1, 8, 8, h0=True, seed=8)
    copies = [t.clone() for t in inputs]
    kda_chunk(*inputs[:5], initial_state=inputs[5], output_final_state=True, backend="torch")
    for a, b in zip(inputs, copies):
        assert torch.equal(a, b)


def test_chunk_empty_sequence():
    q, k, v, g, beta, h0 = make_inputs(1, 0, 2, 8, 4, h0=True)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert o.shape == (1, 0, 2, 4)
    torch.testing.assert_close(S, h0)


def test_chunk_argument_errors():
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 4)
    with pytest.raises(ValueError, match="power of two"):
        kda_chunk(q, k, v, g, beta, chunk_size=48, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        kda_chunk(q, k, v, g, beta, backend="triton")
    with pytest.raises(ValueError, match="g must be"):
        kda_chunk(q, k, v, g[..., :4], beta, backend="torch")
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 8), backend="torch")


def test_fla_backend_on_cpu():
    """Asking for fla explicitly on a machine without it must fail loudly, not fall back."""
    from k3core.ops.kda import chunk as kda_module

    if kda_module._fla_chunk_kda() is not None:
        pytest.skip("fla's Triton chunk_kda imports here")
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 4)
    with pytest.raises(RuntimeError, match="fla"):
        kda_chunk(q, k, v, g, beta, backend="fla")


# ----------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------


def _grads(fn, inputs, cotangents):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    q, k, v, g, beta, h0 = leaves
    o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    loss = (o * cotangents[0]).sum() + (S * cotangents[1]).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "dtype, g_mode, tol",
    [
        (torch.float64, "uniform", 1e-10),
        (torch.float64, "slow", 1e-10),
        (torch.float32, "uniform", 1e-5),
        (torch.float32, "lower_bound", 1e-5),
    ],
)
def test_chunk_gradients_match_recurrent(dtype, g_mode, tol):
    """d/d(q, k, v, g, beta, initial_state) through kda_chunk == through kda_recurrent, T = 100.

    Tolerance is on the relative RMS error of each gradient: 1e-10 in fp64, 1e-5 in fp32.
    """
    inputs = make_inputs(2, 100, 2, 16, 8, g_mode=g_mode, dtype=dtype, h0=True, seed=9)
    gen = torch.Generator().manual_seed(10)
    cot = [
        torch.randn(2, 100, 2, 8, generator=gen, dtype=torch.float64).to(dtype),
        torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64).to(dtype),
    ]
    ref = _grads(kda_recurrent, inputs, cot)
    for chunk_size in (16, 64):
        got = _grads(functools.partial(kda_chunk, chunk_size=chunk_size, backend="torch"), inputs, cot)
        for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], got, ref):
            assert torch.isfinite(a).all(), name
            err = rel_rms(a, b)
            assert err <= tol, f"d{name} (C={chunk_size}): rel RMS {err:.2e}"


def _graph_names(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind t."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("g_mode", ["uniform", "slow", "lower_bound", "extreme"])
def test_chunk_custom_backward_matches_autograd_chunk_path(g_mode):
    """The hand-written backward (_KDAChunkFn) == autograd through the same chunk algorithm, fp32.

    ``output_chunk_states=True`` keeps the autograd path (the Function does not return chunk states),
    so both run the same forward ops: outputs must be bit-identical and every gradient (q, k, v, g,
    beta, initial_state; grouped value heads, T not a multiple of C, clamped gates in "extreme")
    within 1e-5 relative max error (measured: below 5e-7).
    """
    B, T, H, HV, K, V = 2, 45, 1, 2, 8, 6
    inputs = make_inputs(B, T, H, K, V, HV=HV, g_mode=g_mode, h0=True, seed=21)
    gen = torch.Generator().manual_seed(22)
    cot = [torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)]
    for C in (8, 16):
        results = {}
        for custom in (True, False):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            o, S, *_ = kda_chunk(
                *leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=C, backend="torch",
                output_chunk_states=not custom,
            )  # fmt: skip
            assert ("_KDAChunkFnBackward" in _graph_names(o)) == custom
            loss = (o * cot[0]).sum() + (S * cot[1]).sum()
            results[custom] = (o.detach(), S.detach(), *torch.autograd.grad(loss, leaves))
        new, ref = results[True], results[False]
        assert torch.equal(new[0], ref[0]) and torch.equal(new[1], ref[1])
        for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], new[2:], ref[2:]):
            err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            assert err <= 1e-5, f"d{name} (C={C}, {g_mode}): rel max error {err:.2e}"


def test_chunk_custom_backward_gradcheck():
    """float64 gradcheck of kda_chunk through the custom backward on tiny shapes: initial state, two
    chunks and a ragged tail, grouped value heads; its outputs equal the no-grad forward's bit for bit."""
    q, k, v, g, beta, h0 = make_inputs(1, 7, 1, 3, 2, HV=2, dtype=torch.float64, h0=True, seed=23)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        return kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4, backend="torch")

    assert "_KDAChunkFnBackward" in _graph_names(fn(*leaves)[0])
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)
    with torch.no_grad():
        o_ref, S_ref = fn(*leaves)
    o, S = fn(*leaves)
    assert torch.equal(o.detach(), o_ref) and torch.equal(S.detach(), S_ref)


def test_chunk_autograd_after_inference_mode():
    """Cached helpers created under inference_mode must not poison a later autograd call."""
    q, k, v, g, beta = make_inputs(1, 40, 2, 8, 8, seed=11)
    with torch.inference_mode():
        kda_chunk(q, k, v, g, beta, chunk_size=8, backend="torch")
    v = v.clone().requires_grad_()
    o, _ = kda_chunk(q, k, v, g, beta, chunk_size=8, backend="torch")
    o.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("C", [1, 2, 8, 64])
def test_dyadic_tiling_covers_lower_triangle_once(C):
    """Every entry of the C x C lower triangle is read from exactly one stored slot."""
    from k3core.ops.kda.intra_chunk import dyadic_index

    index = torch.tensor(dyadic_index(C)).view(C, C)
    upper = torch.triu(torch.ones(C, C, dtype=torch.bool), diagonal=1)
    assert (index[upper] == 0).all()
    lower = index[~upper]
    assert (lower > 0).all()
    assert lower.unique().numel() == lower.numel() == C * (C + 1) // 2
