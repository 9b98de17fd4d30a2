"""MQAR, multi-query associative recall (Zoology, Arora et al. 2023), inside the byte vocabulary.

With the default ``vocab_size=256`` MQAR keys are drawn from bytes ``128..191`` and values from
``192..255``; the filler token is ``0`` (NUL). The cleaned Shakespeare corpus is pure ASCII
(bytes ``< 128``, no NUL), so none of these tokens ever occur in the text and MQAR sequences can be
mixed into the same byte-level training stream without ambiguity (:func:`mix_mqar`). (Arbitrary
UTF-8 text loaded through ``load_text_path`` may contain bytes ``>= 128``; mixing still works, the
tokens just are not exclusive to MQAR anymore.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .batches import IGNORE_INDEX


@dataclass
class MQARBatch:
    """A batch of MQAR sequences.

    * ``inputs`` ``[N, T]`` int64 -- ``k1 v1 k2 v2 ... kD vD`` then the query region: filler tokens
      with query keys at ``query_positions``.
    * ``targets`` ``[N, T]`` int64 -- ``IGNORE_INDEX`` everywhere except at query positions, where
      the target (the next token to predict) is the value bound to that key in the context.
    * ``keys`` / ``values`` ``[N, D]`` -- the context pairs in order (``inputs[:, 0:2D:2]`` /
      ``inputs[:, 1:2D:2]``).
    * ``query_positions`` / ``query_keys`` / ``query_values`` ``[N, Q]`` -- where each query sits
      (ascending), its key and its expected answer.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    query_positions: torch.Tensor
    query_keys: torch.Tensor
    query_values: torch.Tensor
    filler_token: int = 0

    @property
    def answer_mask(self) -> torch.Tensor:
        return self.targets != IGNORE_INDEX


def _default_mqar_ranges(vocab_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    half, three_q = vocab_size // 2, (3 * vocab_size) // 4
    return (half, three_q), (three_q, vocab_size)


def mqar_chance(vocab_size: int = 256) -> float:
    """Accuracy of a uniform guess among the value tokens of the default ranges: 1 / |values| (1/64 for bytes)."""
    lo, hi = _default_mqar_ranges(vocab_size)[1]
    return 1.0 / (hi - lo)


def _rand_perm_rows(n: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` independent random permutations of ``range(k)``, shape ``[n, k]``."""
    return torch.rand(n, k, generator=generator).argsort(dim=1)


def make_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int = 256,
    generator: torch.Generator | None = None,
    key_range: tuple[int, int] | None = None,
    value_range: tuple[int, int] | None = None,
    num_queries: int | None = None,
    filler_token: int = 0,
    query_placement: str = "random",
) -> MQARBatch:
    """Generate multi-query associative recall examples (Zoology, Arora et al. 2023).

    Layout of each length-``seq_len`` example, with ``D = num_kv_pairs``:

    * positions ``0 .. 2D-1``: the context ``k1 v1 k2 v2 ... kD vD``. Keys are distinct within an
      example and drawn from ``key_range``; values are distinct within an example and drawn from
      ``value_range``; the two (half-open ``[lo, hi)``) ranges are disjoint.
    * positions ``2D .. seq_len-1``: the query region, filled with ``filler_token``; ``Q``
      (``num_queries``, default ``D``) distinct context keys, in random order, are written at
      ``Q`` distinct positions. ``query_placement="random"`` (default, as in Zoology) scatters
      them uniformly over the region with filler in between; ``"contiguous"`` puts them right
      after the context.
    * ``targets`` is ``IGNORE_INDEX`` except at each query position, whose target (next-token
      prediction) is the value paired with that key in the context.

    Defaults for ``vocab_size=256``: keys in ``[128, 192)``, values in ``[192, 256)`` -- bytes that
    ASCII text never contains -- and filler ``0`` (NUL), so MQAR can be mixed into byte-level text
    training. For other vocab sizes the defaults are ``[V/2, 3V/4)`` and ``[3V/4, V)``.
    """
    if num_examples < 1 or seq_len < 1 or num_kv_pairs < 1:
        raise ValueError("num_examples, seq_len and num_kv_pairs must be >= 1")
    d_keys, d_values = _default_mqar_ranges(vocab_size)
    k_lo, k_hi = key_range if key_range is not None else d_keys
    v_lo, v_hi = value_range if value_range is not None else d_values
    for name, (lo, hi) in (("key_range", (k_lo, k_hi)), ("value_range", (v_lo, v_hi))):
        if not 0 <= lo < hi <= vocab_size:
            raise ValueError(f"{name}=({lo}, {hi}) must satisfy 0 <= lo < hi <= vocab_size={vocab_size}")
    if k_lo < v_hi and v_lo < k_hi:
        raise ValueError(f"key_range ({k_lo}, {k_hi}) and value_range ({v_lo}, {v_hi}) overlap")
    if k_lo <= filler_token < k_hi or v_lo <= filler_token < v_hi or not 0 <= filler_token < vocab_size:
        raise ValueError(f"filler_token={filler_token} must be in the vocab and outside key/value ranges")
    n_keys, n_values = k_hi - k_lo, v_hi - v_lo
    if num_kv_pairs > n_keys or num_kv_pairs > n_values:
        raise ValueError(f"num_kv_pairs={num_kv_pairs} exceeds the key ({n_keys}) or value ({n_values}) range size")
    q = num_kv_pairs if num_queries is None else int(num_queries)
    ctx = 2 * num_kv_pairs
    region = seq_len - ctx
    if q < 1:
        raise ValueError(f"num_queries must be >= 1, got {q}")
    if region < q:
        raise ValueError(f"seq_len={seq_len} too short: need 2*num_kv_pairs + num_queries = {ctx + q} positions")
    if query_placement not in ("random", "contiguous"):
        raise ValueError(f"query_placement must be 'random' or 'contiguous', got {query_placement!r}")

    n = num_examples
    keys = _rand_perm_rows(n, n_keys, generator)[:, :num_kv_pairs] + k_lo
    values = _rand_perm_rows(n, n_values, generator)[:, :num_kv_pairs] + v_lo
    # which pairs get queried, in order: one permutation of the pairs per round of D queries
    rounds = -(-q // num_kv_pairs)
    which = torch.cat([_rand_perm_rows(n, num_kv_pairs, generator) for _ in range(rounds)], dim=1)[:, :q]
    if rounds > 1:  # shuffled, so the repeats of a key are spread over the region, not one round after another
        which = which.gather(1, _rand_perm_rows(n, q, generator))
    query_keys = keys.gather(1, which)
    query_values = values.gather(1, which)
    if query_placement == "random":
        pos = _rand_perm_rows(n, region, generator)[:, :q].sort(dim=1).values + ctx
    else:
        pos = (torch.arange(q) + ctx).expand(n, q).clone()

    inputs = torch.full((n, seq_len), filler_token, dtype=torch.int64)
    inputs[:, 0:ctx:2] = keys
    inputs[:, 1:ctx:2] = values
    inputs.scatter_(1, pos, query_keys)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    targets.scatter_(1, pos, query_values)
    return MQARBatch(
        inputs=inputs,
        targets=targets,
        keys=keys.to(torch.int64),
        values=values.to(torch.int64),
        query_positions=pos.to(torch.int64),
        query_keys=query_keys.to(torch.int64),
        query_values=query_values.to(torch.int64),
        filler_token=filler_token,
    )


def segment_queries(num_queries: int, seq_len: int, span: int) -> int:
    """Queries of one packed segment of ``span`` tokens: the row's ``num_queries`` per ``seq_len`` tokens,
    pro rata, ``max(1, floor(num_queries * span / seq_len))``, so packing keeps the answer density."""
    return max(1, num_queries * span // seq_len)


def make_mqar_packed(
    num_examples: int,
    seq_len: int,
    span: int,
    num_kv_pairs: int,
    num_queries: int | None = None,
    generator: torch.Generator | None = None,
    **mqar_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR rows of ``seq_len`` tokens packed from independent examples of ``span`` tokens: ``(inputs, targets)``.

    Each row is ``ceil(seq_len / span)`` segments laid end to end, each a :func:`make_mqar` example of its own
    length (``span``; the last one takes what is left) with its own pairs and
    :func:`segment_queries` ``(Q, seq_len, length)`` queries, ``Q = num_queries`` (default ``num_kv_pairs``) per
    row. A query's answer is bound in its own segment, so the distance from a binding to its query is below
    ``span``; the pairs of earlier segments stay in the context as distractors. A last segment too short to
    hold ``2 * num_kv_pairs`` + its queries is filler with no answers. ``span >= seq_len`` is plain
    :func:`make_mqar`, with the same draws from ``generator``. Short spans are the length curriculum that
    lets a model find the recall circuit before it must reach across the whole row.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    q_row = num_kv_pairs if num_queries is None else int(num_queries)
    if span >= seq_len:
        mq = make_mqar(num_examples, seq_len, num_kv_pairs, generator=generator, num_queries=q_row, **mqar_kwargs)
        return mq.inputs, mq.targets
    filler = int(mqar_kwargs.get("filler_token", 0))
    inputs = torch.full((num_examples, seq_len), filler, dtype=torch.int64)
    targets = torch.full((num_examples, seq_len), IGNORE_INDEX, dtype=torch.int64)
    for start in range(0, seq_len, span):
        length = min(span, seq_len - start)
        q = segment_queries(q_row, seq_len, length)
        if length < 2 * num_kv_pairs + q:
            continue  # a tail too short for a whole example: filler, nothing scored
        mq = make_mqar(num_examples, length, num_kv_pairs, generator=generator, num_queries=q, **mqar_kwargs)
        inputs[:, start : start + length] = mq.inputs
        targets[:, start : start + length] = mq.targets
    return inputs, targets


def mqar_accuracy(logits: torch.Tensor, batch: MQARBatch | torch.Tensor) -> float:
    """Fraction of answer positions (targets != ``IGNORE_INDEX``) where ``argmax(logits)`` is right.

    ``logits`` is ``[N, T, V]``; ``batch`` is an :class:`MQARBatch` or its ``targets`` tensor.
    Returns ``nan`` if there are no answer positions.
    """
    targets = batch.targets if isinstance(batch, MQARBatch) else batch
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    mask = targets != IGNORE_INDEX
    n = int(mask.sum())
    if n == 0:
        return math.nan
    pred = logits.detach().argmax(dim=-1).to(targets.device)
    return float((pred[mask] == targets[mask]).sum().item() / n)


def mix_mqar(
    x: torch.Tensor,
    y: torch.Tensor,
    mqar_fraction: float,
    num_kv_pairs: int,
    generator: torch.Generator | None = None,
    span: int | None = None,
    **mqar_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Replace a fraction of the rows of a text batch ``(x, y)`` with MQAR sequences.

    The number of replaced rows is ``mqar_fraction * B`` with stochastic rounding (using
    ``generator``), so the expected MQAR share equals ``mqar_fraction`` even for small batches.
    The **last** ``k`` rows are replaced: ``x`` gets MQAR inputs, ``y`` gets MQAR targets
    (``IGNORE_INDEX`` except at answers, so train with ``ignore_index=IGNORE_INDEX``). Returns new
    tensors ``(x, y, k)``; the inputs are not modified. ``mqar_kwargs`` go to :func:`make_mqar`
    (``vocab_size``, ``key_range``, ``value_range``, ``num_queries``, ...). With ``span`` shorter than the
    row, each MQAR row is packed from examples of ``span`` tokens (:func:`make_mqar_packed`).
    """
    if not 0.0 <= mqar_fraction <= 1.0:
        raise ValueError(f"mqar_fraction must be in [0, 1], got {mqar_fraction}")
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"x and y must both be [B, T], got {tuple(x.shape)} and {tuple(y.shape)}")
    b, t = x.shape
    expected = mqar_fraction * b
    k = int(math.floor(expected))
    frac = expected - k
    if frac > 0 and float(torch.rand((), generator=generator)) < frac:
        k += 1
    x, y = x.clone(), y.clone()
    if k > 0:
        if span is None or span >= t:
            mq = make_mqar(k, t, num_kv_pairs, generator=generator, **mqar_kwargs)
            rows_x, rows_y = mq.inputs, mq.targets
        else:
            rows_x, rows_y = make_mqar_packed(k, t, span, num_kv_pairs, generator=generator, **mqar_kwargs)
        x[b - k :] = rows_x.to(x.device, x.dtype)
        y[b - k :] = rows_y.to(y.device, y.dtype)
    return x, y, k
