"""Fuzzing the checkpoint readers (issue 14): whatever a safetensors header or a config.json holds, only the
project's own error types come out (CheckpointError; LibraryError one layer up), never a traceback of
RecursionError, OverflowError, MemoryError, TypeError, KeyError, ...

Hypothesis runs a few hundred derandomised cases (the same ones on every run, so the suite never flakes):
arbitrary JSON as a whole header, mutations of a valid header (a field replaced by any JSON value, the length
prefix or the bytes changed), and mutations of real config.json files (k3lab's own, Kimi Linear's, Kimi K3's).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from app.library.run_folders import LibraryError, describe_folder
from k3core.loading.folder import CheckpointFiles, read_config
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.config import K3Config
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**18, 10**30, 10**4000]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=30))
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=25,
)


def _dumps(value) -> bytes:
    """JSON text as a hostile writer would produce it (NaN / Infinity allowed, huge integers written out)."""
    import sys

    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.dumps(value).encode()
    finally:
        sys.set_int_max_str_digits(old)


@pytest.fixture(scope="module")
def work() -> Path:
    with tempfile.TemporaryDirectory(prefix="k3lab-fuzz-") as d:
        yield Path(d)


# ----------------------------------------------------------------------------------------- headers
def _open_all(path: Path) -> None:
    """Everything a reader does with a file: open the headers, count, read every tensor."""
    files = CheckpointFiles.open(path, require_config=False)
    assert files.num_parameters >= 0 and files.bytes_total >= 0
    for name in list(files.tensors)[:4]:
        files.read(name)


def _only_checkpoint_errors(path: Path) -> None:
    try:
        _open_all(path)
    except CheckpointError as exc:
        assert str(exc) and len(str(exc)) < 2000  # a message, and a bounded one
    try:
        describe_folder(path.parent, label="fuzz")
    except LibraryError:
        pass


@pytest.fixture(scope="module")
def valid_header(work) -> tuple[dict, bytes]:
    import torch

    path = work / "valid.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@FUZZ
@given(header=JSON, data=st.binary(max_size=64))
def test_any_json_as_a_header(work, header, data):
    folder = work / "any"
    folder.mkdir(exist_ok=True)
    raw = _dumps(header)
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    _only_checkpoint_errors(folder / "model.safetensors")


@FUZZ
@given(
    entry=st.sampled_from(["a", "b", "__metadata__", "c"]),
    field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
    value=JSON,
    length_delta=st.sampled_from([0, 0, 0, -1, 1, -(2**40), 2**40]),
    cut=st.integers(min_value=0, max_value=200),
)
def test_mutated_headers(work, valid_header, entry, field, value, length_delta, cut):
    header, data = json.loads(json.dumps(valid_header[0])), valid_header[1]
    if field is None:
        header[entry] = value
    else:
        header.setdefault(entry, {})
        if isinstance(header[entry], dict):
            header[entry][field] = value
    raw = _dumps(header)
    length = max(0, min(len(raw) + length_delta, 2**64 - 1))
    blob = length.to_bytes(8, "little") + raw + data
    folder = work / "mutated"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(blob[: len(blob) - cut] if cut < 100 else blob)
    _only_checkpoint_errors(folder / "model.safetensors")


# ----------------------------------------------------------------------------------------- config.json
def _configs() -> dict[str, dict]:
    from benchmarks.k3_replica import kimi_k3_hf_dict
    from tests.k3core.modeling.test_hf_config import kimi_linear_hf_dict

    return {"own": from_preset("k3-nano").to_dict(), "kimi_linear": kimi_linear_hf_dict(), "kimi_k3": kimi_k3_hf_dict()}


CONFIGS = _configs()
KEYS = sorted({k for c in CONFIGS.values() for k in c} | {"text_config", "linear_attn_config", "layer_types"})


def _small(cfg: K3Config) -> bool:
    """Small enough to build on the meta device in milliseconds (the fuzz stays within seconds)."""
    return cfg.num_hidden_layers <= 8 and cfg.num_experts <= 64 and cfg.hidden_size <= 4096


@FUZZ
@given(
    base=st.sampled_from(sorted(CONFIGS)),
    edits=st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(JSON, st.just("<delete>"))), min_size=1, max_size=3),
    nested=st.booleans(),
)
def test_mutated_config_json(work, base, edits, nested):
    data = json.loads(json.dumps(CONFIGS[base]))
    target = data["text_config"] if nested and isinstance(data.get("text_config"), dict) else data
    for key, value in edits:
        if value == "<delete>":
            target.pop(key, None)
        else:
            target[key] = value
    folder = work / "config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_bytes(_dumps(data))
    try:
        cfg = read_config(folder)
    except CheckpointError as exc:
        assert str(exc) and len(str(exc)) < 2000
        return
    assert isinstance(cfg, K3Config)
    if _small(cfg):
        try:
            plan = K3ForCausalLM.plan_placement(folder, "cpu")
        except CheckpointError:
            return
        assert plan.total_bytes > 0 and math.isfinite(plan.total_bytes)


@FUZZ
@given(data=st.binary(max_size=400), keep=st.integers(min_value=0, max_value=600))
def test_config_json_bytes(work, data, keep):
    folder = work / "bytes"
    folder.mkdir(exist_ok=True)
    raw = _dumps(CONFIGS["own"])
    (folder / "config.json").write_bytes(raw[:keep] + data)
    try:
        read_config(folder)
    except CheckpointError:
        pass
