"""The untrained twin (analysis.runs.twin): the run's config on random weights, seeded and built once; its MLA
attention sits at the uniform-attention level (analysis.metrics.null_reference), which is what lets a view tell
learned structure from initialisation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.metrics import attention as at
from analysis.metrics import null_reference as nr
from analysis.runs import twin as tw
from analysis.runs.loading import load_run, trace_run
from analysis.runs.texts import sample_input
from k3core import training as T

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"
TOKENS = 256
#: the interval the twin's first-token mass must lie in around H_T / T: random init attention logits are near zero
#: (their spread ~ init std^2 * width), so each row is within a few percent of uniform
TWIN_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def run():
    return load_run(SAMPLE)


def test_the_twin_is_seeded_built_once_and_leaves_the_random_stream_alone(run):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    twin = tw.untrained_twin(run)
    assert torch.equal(torch.rand(3), before)  # building it did not move the caller's random stream
    again = tw.untrained_twin(run)
    assert again.model is twin.model and twin.fingerprint == again.fingerprint != run.fingerprint
    trained = dict(run.model.named_parameters())
    fresh = dict(twin.model.named_parameters())
    assert trained.keys() == fresh.keys()
    assert any(not torch.equal(trained[k], fresh[k]) for k in trained)  # other weights, same shapes
    assert all(trained[k].shape == fresh[k].shape for k in trained)
    # the weights a k3lab train run of this config and the run's own seed starts from
    assert tw.run_seed(run) == run.metrics["seed"]
    start = T.initial_model(run.config, run.metrics["seed"]).state_dict()
    assert all(torch.equal(start[k], v) for k, v in twin.model.state_dict().items())
    other_seed = tw.untrained_twin(run, seed=1)
    name = next(k for k, v in fresh.items() if v.ndim == 2)
    assert not torch.equal(dict(other_seed.model.named_parameters())[name], fresh[name])


def test_the_twins_mla_sink_mass_lies_within_its_interval_of_the_uniform_level(run):
    twin = tw.untrained_twin(run)
    ctx = trace_run(twin, sample_input("shakespeare", run.config, TOKENS, run.tokenizer), label="twin")
    table = at.attention_sink_table(ctx.trace)
    uniform = nr.uniform_first_token_mass(at.attention_tokens(ctx.trace))
    assert len(table) >= 2
    np.testing.assert_allclose(table["first_token_mass"], uniform, rtol=TWIN_TOLERANCE)
    assert all(nr.relative_to(m, uniform) == "at" for m in table["first_token_mass"])
    received = at.attention_received_table(ctx.trace, max_keys=16)
    np.testing.assert_allclose(
        received["received"], nr.uniform_received(TOKENS, received["key"].to_numpy()), rtol=4 * TWIN_TOLERANCE
    )


def test_a_config_too_large_gets_a_note_and_no_twin(run):
    big = replace(run.config, hidden_size=8192, num_hidden_layers=96, vocab_size=160_000)
    note = tw.twin_too_large(big)
    assert note is not None and "parameters" in note and f"{tw.TWIN_MAX_PARAMETERS:,}" in note
    assert tw.twin_too_large(run.config) is None
    with pytest.raises(ValueError, match="No untrained twin"):
        tw.untrained_twin(replace(run, config=big))
