"""Kimi Delta Attention (KDA) token mixer: recurrent reference, single decode step, chunked form.

Layouts follow flash-linear-attention's ``naive_recurrent_kda``::

    q, k  : [B, T, H, K]     (already L2-normalised per head)
    v     : [B, T, HV, V]    (HV == H for K3; HV may be a multiple of H, "grouped values")
    g     : [B, T, HV, K]    log of the per-channel decay alpha = exp(g), g <= 0
    beta  : [B, T, HV]       write strength in (0, 1)
    state : [B, HV, K, V]    keys x values, fp32

Per head, with D_t = Diag(exp(g_t)) and s = scale (default K**-0.5)::

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (s q_t)

i.e. decay the state per key channel, read the prediction ``(D_t S_{t-1})^T k_t``, write
``beta_t k_t (v_t - prediction)^T`` (the delta rule), then read with the scaled query.

Entry points (import them from here):

* :func:`kda_step`: one decoding step (the single definition of the recurrence).
* :func:`kda_recurrent`: loops :func:`kda_step` over time; the reference.
* :func:`kda_chunk`: the chunked (WY / UT-transform) algorithm in pure PyTorch, or fla's Triton
  kernel on CUDA when it is installed.
* :func:`kda_chunk_end_states`: the state at every chunk end (a reference for the states
  ``kda_chunk(output_chunk_states=True)`` returns).

Where they live: ``naive.py`` (the recurrent form: ``kda_step``, ``kda_recurrent``), ``chunk.py``
(the chunked form: ``kda_chunk``, ``kda_chunk_end_states``, fla dispatch, the chunk backward), ``intra_chunk.py``
(inside one chunk: the dyadic scores and the UT inverse, forward and backward) and ``gate.py`` (the decay gate).

All arithmetic is done in fp32 (fp64 if any input is fp64); outputs are cast to ``v.dtype`` and
final states are returned in the compute dtype.
"""

from .chunk import kda_chunk, kda_chunk_end_states
from .naive import kda_recurrent, kda_step

__all__ = ["kda_step", "kda_recurrent", "kda_chunk", "kda_chunk_end_states"]
