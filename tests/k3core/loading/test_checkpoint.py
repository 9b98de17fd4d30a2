"""Checkpoint I/O: bit-exact round trips, published key names, HF layouts, and one clear error per bad case."""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from k3core.loading.folder import INDEX_NAME, WEIGHTS_NAME, folder_fingerprint
from k3core.loading.names import keep_fp32
from k3core.loading.pretrained import export_state_dict, save_pretrained
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.hf_config import config_from_hf
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from tests.conftest import nano_model, randomize_attnres_queries

load_pretrained = K3ForCausalLM.from_pretrained


def _varied_nano(**overrides) -> K3ForCausalLM:
    """A k3-nano whose zero-initialised parameters and buffers hold non-trivial values too."""
    model = nano_model(**overrides)
    randomize_attnres_queries(model)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.01)
    return model


def _assert_same_model(a: K3ForCausalLM, b: K3ForCausalLM, ids: torch.Tensor) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key
    with torch.no_grad():
        assert torch.equal(a.eval()(ids).logits, b.eval()(ids).logits)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[K3ForCausalLM, pathlib.Path]:
    model = _varied_nano()
    path = tmp_path_factory.mktemp("ckpt") / "nano"
    model.save_pretrained(path)
    return model, path


@pytest.fixture
def bad(saved, tmp_path) -> pathlib.Path:
    """A fresh copy of a good checkpoint folder, to break."""
    return pathlib.Path(shutil.copytree(saved[1], tmp_path / "bad"))


# ------------------------------------------------------------------------------------------ round trips


def test_round_trip_is_bit_exact(saved, tokens):
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == ["config.json", WEIGHTS_NAME]
    loaded = K3ForCausalLM.from_pretrained(path)
    assert loaded.config == model.config and not loaded.training
    _assert_same_model(model, loaded, tokens)


def test_sharded_round_trip_is_bit_exact(tmp_path, tokens):
    model = _varied_nano()
    save_pretrained(model, tmp_path, max_shard_bytes=60_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / WEIGHTS_NAME).exists()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert set(index["weight_map"]) == set(export_state_dict(model))
    _assert_same_model(model, load_pretrained(tmp_path), tokens)
    # Saving again unsharded removes the shards and the index: a folder never mixes layouts.
    save_pretrained(model, tmp_path)
    assert not list(tmp_path.glob("model-*-of-*")) and not (tmp_path / INDEX_NAME).exists()
    _assert_same_model(model, load_pretrained(tmp_path), tokens)


@pytest.mark.parametrize("residual", ["full_attnres", "scale_bias", "plain"])
def test_round_trip_other_residual_modes(tmp_path, tokens, residual):
    model = _varied_nano(residual=residual, kda_gate="softplus", kda_output_gate="low_rank", q_lora_rank=None)
    model.save_pretrained(tmp_path)
    _assert_same_model(model, load_pretrained(tmp_path), tokens)


def test_tied_embeddings_round_trip(tmp_path, tokens):
    model = _varied_nano(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _assert_same_model(model, loaded, tokens)


def test_bf16_load_keeps_the_fp32_tensors_in_fp32(tmp_path, tokens):
    """The keep-fp32 rule (k3core.loading.names.keep_fp32): stored F32, loaded F32 under dtype=bf16, and the
    forward runs (the short convolutions compute in their fp32 weights' dtype)."""
    model = _varied_nano()
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, dtype=torch.bfloat16)
    kept = {k for k in loaded.state_dict() if keep_fp32(k)}
    assert {"model.layers.1.self_attn.A_log", "model.layers.1.self_attn.dt_bias",
            "model.layers.1.self_attn.q_conv1d.weight", "model.layers.1.self_attn.o_norm.weight",
            "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"} <= kept  # fmt: skip
    for key, value in loaded.state_dict().items():
        assert value.dtype == (torch.float32 if key in kept else torch.bfloat16), key
        want = model.state_dict()[key]
        assert torch.equal(value, want if key in kept else want.to(torch.bfloat16)), key
    with torch.no_grad():
        got = loaded(tokens).logits.float()
        ref = model(tokens).logits
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 rounding of the other weights only


def test_bf16_checkpoint_round_trip(tmp_path, tokens):
    """A bf16 checkpoint (keep-fp32 tensors stored in F32) loads bit-exactly, twice the same."""
    model = load_pretrained(_save(_varied_nano(), tmp_path / "a"), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "b")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "b" / WEIGHTS_NAME), framework="pt") as f:
        assert f.get_slice("model.layers.1.self_attn.dt_bias").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.self_attn.q_proj.weight").get_dtype() == "BF16"
    _assert_same_model(model, load_pretrained(tmp_path / "b", dtype=torch.bfloat16), tokens)


def _save(model, path):
    model.save_pretrained(path)
    return path


def test_published_key_names(saved):
    keys = set(saved[0].state_dict())
    L = "model.layers"
    expected = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.output_attn_res_norm.weight",
        "model.output_attn_res_proj.weight",
        # every layer: norms and AttnRes pseudo-queries
        *(
            f"{L}.{i}.{n}.weight"
            for i in range(4)
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attention_res_norm",
                "self_attention_res_proj",
                "mlp_res_norm",
                "mlp_res_proj",
            )
        ),
        # KDA (layer 1)
        *(
            f"{L}.1.self_attn.{n}.weight"
            for n in (
                "q_proj",
                "k_proj",
                "v_proj",
                "g_proj",
                "o_proj",
                "f_a_proj",
                "f_b_proj",
                "b_proj",
                "q_conv1d",
                "k_conv1d",
                "v_conv1d",
                "o_norm",
            )
        ),
        f"{L}.1.self_attn.A_log",
        f"{L}.1.self_attn.dt_bias",
        # MLA (layer 4 in 1-based terms)
        *(
            f"{L}.3.self_attn.{n}.weight"
            for n in (
                "q_a_proj",
                "q_a_layernorm",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_a_layernorm",
                "kv_b_proj",
                "g_proj",
                "o_proj",
            )
        ),
        # dense FFN (first layer)
        *(f"{L}.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")),
        # LatentMoE
        f"{L}.1.block_sparse_moe.gate.weight",
        f"{L}.1.block_sparse_moe.gate.e_score_correction_bias",
        *(
            f"{L}.1.block_sparse_moe.{n}.weight"
            for n in ("routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj")
        ),
        *(f"{L}.1.block_sparse_moe.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")),
        *(f"{L}.1.block_sparse_moe.experts.{e}.{w}.weight" for e in range(8) for w in ("w1", "w2", "w3")),
    ]
    missing = [k for k in expected if k not in keys]
    assert not missing, missing
    cfg = saved[0].config
    sd = saved[0].state_dict()
    assert sd[f"{L}.1.block_sparse_moe.experts.0.w1.weight"].shape == (cfg.moe_intermediate_size, 32)
    assert sd[f"{L}.1.block_sparse_moe.experts.0.w2.weight"].shape == (32, cfg.moe_intermediate_size)
    assert sd[f"{L}.1.self_attn.q_conv1d.weight"].shape == (32, 1, 4)
    assert not any(".experts.w1" in k for k in keys)  # the stacked storage never leaks into the names


TINY_K3_TEXT = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
    "intermediate_size": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 2, "head_dim": 16,
                           "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_output_gate": True, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
    "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "attn_res_block_size": 2,
}  # fmt: skip


def test_hf_k3_release_layout_loads(tmp_path, tokens):
    """config.json with a kimi_k3 wrapper, keys under language_model., A_log padded to head_dim with zeros."""
    cfg = config_from_hf({"model_type": "kimi_k3", "text_config": TINY_K3_TEXT})
    assert cfg.replace(name="k3-nano") == from_preset("k3-nano")
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config(cfg).eval()
    tensors = {}
    for key, value in export_state_dict(model).items():
        if key.endswith("self_attn.A_log"):
            value = torch.cat([value, torch.zeros(16 - value.numel())])
        tensors["language_model." + key] = value
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": TINY_K3_TEXT}))
    _assert_same_model(model, load_pretrained(tmp_path), tokens)
    # A padded A_log whose padding is not zero is a real mismatch, not silently cut.
    bad_a = dict(tensors)
    bad_a["language_model.model.layers.0.self_attn.A_log"] = torch.ones(16)
    save_file(bad_a, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(CheckpointError, match="A_log"):
        load_pretrained(tmp_path)


def test_kimi_linear_a_log_shape_is_accepted(tmp_path, tokens):
    model = _varied_nano(kda_gate="softplus", kda_output_gate="low_rank")
    model.save_pretrained(tmp_path)
    tensors = export_state_dict(model)
    for key in [k for k in tensors if k.endswith("A_log")]:
        tensors[key] = tensors[key].view(1, 1, -1, 1)  # how Kimi Linear stores it
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    _assert_same_model(model, load_pretrained(tmp_path), tokens)


def test_plain_state_dict_bin_loads(saved, tmp_path, tokens):
    model, path = saved
    shutil.copy(path / "config.json", tmp_path / "config.json")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    _assert_same_model(model, load_pretrained(tmp_path), tokens)


def test_fingerprint_follows_the_content(saved, bad):
    assert folder_fingerprint(saved[1]) == folder_fingerprint(bad)
    data = bytearray((bad / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 1
    (bad / WEIGHTS_NAME).write_bytes(bytes(data))
    assert folder_fingerprint(saved[1]) != folder_fingerprint(bad)


# ------------------------------------------------------------------------------------------ bad checkpoints


def _load_fails(path, *words) -> str:
    """load_pretrained raises CheckpointError (any other type fails the test) whose message has all words."""
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    return message


def _edit_config(folder: pathlib.Path, **changes) -> None:
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))


def _rewrite(folder: pathlib.Path, change) -> None:
    """Re-save model.safetensors after ``change(tensors)`` edits the tensor dict."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / WEIGHTS_NAME))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS_NAME))


def test_missing_folder(tmp_path):
    _load_fails(tmp_path / "nowhere", "nowhere", "no such checkpoint")


def test_config_missing(bad):
    (bad / "config.json").unlink()
    _load_fails(bad, "config.json is missing")


def test_config_invalid_json(bad):
    (bad / "config.json").write_text('{"hidden_size": 64,')
    _load_fails(bad, "config.json", "not valid JSON")


@pytest.mark.parametrize(
    "changes, word",
    [
        ({"hidden_size": -4}, "hidden_size"),
        ({"residual": "dense"}, "residual"),
        ({"num_experts": None}, "num_experts"),
        ({"full_attn_layers": [9]}, "full_attn_layers"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps"),
    ],
)
def test_config_invalid_values(bad, changes, word):
    _edit_config(bad, **changes)
    _load_fails(bad, "invalid config", word)


def test_config_unknown_fields(bad):
    _edit_config(bad, hiden_size=64)
    _load_fails(bad, "unknown config fields", "hiden_size")


def test_config_not_an_object(bad):
    (bad / "config.json").write_text("[1, 2, 3]")
    _load_fails(bad, "JSON object")


def test_weights_missing(bad):
    (bad / WEIGHTS_NAME).unlink()
    _load_fails(bad, "no weights found")


def test_weights_random_bytes(bad):
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8).numpy().tobytes()
    (bad / WEIGHTS_NAME).write_bytes(b"\x11" + data)
    _load_fails(bad, WEIGHTS_NAME, "not a safetensors file")


def test_weights_tiny_file(bad):
    (bad / WEIGHTS_NAME).write_bytes(b"abc")
    _load_fails(bad, "not a safetensors file")


def test_weights_truncated(bad):
    data = (bad / WEIGHTS_NAME).read_bytes()
    (bad / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    _load_fails(bad, WEIGHTS_NAME, "truncated")


@pytest.mark.parametrize(
    "header",
    [
        b"\xff\xfe not json at all \x00\x01",
        b'["a", "list"]',
        b'{"x": 5}',
        b'{"x": {"dtype": "F32", "shape": [2]}}',
        b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": "0-8"}}',
        b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}',
    ],
)
def test_weights_corrupt_header(bad, header):
    data = (bad / WEIGHTS_NAME).read_bytes()
    n = int.from_bytes(data[:8], "little")
    (bad / WEIGHTS_NAME).write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])
    _load_fails(bad, WEIGHTS_NAME, "corrupt safetensors header")


def test_weights_header_inconsistent_with_data(bad):
    header = b'{"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}'
    (bad / WEIGHTS_NAME).write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    _load_fails(bad, WEIGHTS_NAME, "corrupt")


def test_missing_tensor(bad):
    key = "model.layers.2.self_attn.dt_bias"
    _rewrite(bad, lambda t: t.pop(key))
    _load_fails(bad, "missing tensor", key)


def test_missing_expert(bad):
    key = "model.layers.1.block_sparse_moe.experts.7.w2.weight"
    _rewrite(bad, lambda t: t.pop(key))
    _load_fails(bad, "missing tensor", key)


def test_unexpected_tensor(bad):
    _rewrite(bad, lambda t: t.update({"model.layers.9.self_attn.q_proj.weight": torch.zeros(2, 2)}))
    _load_fails(bad, "unexpected tensor", "model.layers.9.self_attn.q_proj.weight")


def test_unexpected_expert(bad):
    key = "model.layers.1.block_sparse_moe.experts.8.w1.weight"
    _rewrite(bad, lambda t: t.update({key: torch.zeros(32, 32)}))
    _load_fails(bad, "unexpected tensor", key)


def test_mis_shaped_tensor(bad):
    key = "model.layers.3.self_attn.kv_b_proj.weight"
    _rewrite(bad, lambda t: t.update({key: torch.zeros(3, 16)}))
    _load_fails(bad, "mis-shaped", key, "(3, 16)")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values(bad, value):
    key = "model.layers.0.mlp.up_proj.weight"

    def poison(t):
        t[key][3, 5] = value

    _rewrite(bad, poison)
    _load_fails(bad, "NaN or Inf", key)


def test_shard_listed_in_index_is_missing(tmp_path):
    save_pretrained(_varied_nano(), tmp_path, max_shard_bytes=60_000)
    victim = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    _load_fails(tmp_path, "missing", victim.name)


def test_invalid_shard_index(tmp_path):
    save_pretrained(_varied_nano(), tmp_path, max_shard_bytes=60_000)
    (tmp_path / INDEX_NAME).write_text("{not json")
    _load_fails(tmp_path, INDEX_NAME, "invalid shard index")


class _TouchOnUnpickle:
    """Unpickling this runs pathlib.Path.touch(marker): the test's stand-in for arbitrary code execution."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("name, writer", [("pytorch_model.bin", "torch"), ("model.pt", "pickle")])
def test_malicious_pickle_is_never_unpickled(saved, tmp_path, name, writer):
    marker = tmp_path / "pwned"
    payload = {"model.embed_tokens.weight": _TouchOnUnpickle(marker)}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(saved[1] / "config.json", folder / "config.json")
    if writer == "torch":
        torch.save(payload, folder / name)
    else:
        with open(folder / name, "wb") as fh:
            pickle.dump(payload, fh)
    # Control: plain unpickling of this very file's pickle stream really would run the payload
    # (for torch.save's zip layout, the stream is the archive's data.pkl; no tensors inside).
    if writer == "pickle":
        with open(folder / name, "rb") as fh:
            pickle.load(fh)
    else:
        with zipfile.ZipFile(folder / name) as archive:
            stream = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            pickle.loads(archive.read(stream))
    assert marker.exists()
    marker.unlink()
    _load_fails(folder, name, "refusing to load this pickle file")
    assert not marker.exists()


def test_pickle_of_non_tensors_is_refused(saved, tmp_path):
    shutil.copy(saved[1] / "config.json", tmp_path / "config.json")
    torch.save({"model.embed_tokens.weight": [1, 2, 3]}, tmp_path / "pytorch_model.bin")
    _load_fails(tmp_path, "pytorch_model.bin", "plain dict of tensors")


def test_pickle_renamed_as_safetensors(saved, bad):
    torch.save(saved[0].state_dict(), bad / WEIGHTS_NAME)
    _load_fails(bad, WEIGHTS_NAME, "not safetensors")


# ------------------------------------------------------------------------------------------ streaming loader


def test_progress_reports_every_byte_once(saved):
    seen = []
    model = load_pretrained(saved[1], progress=lambda done, total: seen.append((done, total)))
    total = sum(v.numel() * v.element_size() for v in export_state_dict(saved[0]).values())
    assert seen[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))  # one call per tensor, increasing
    assert len(seen) == len(export_state_dict(model))


def test_multimodal_tensors_are_skipped_and_listed(saved, tmp_path, tokens):
    from safetensors.torch import load_file

    from k3core.loading.folder import CheckpointFiles

    model, path = saved
    tensors = {"language_model." + k: v for k, v in load_file(str(path / WEIGHTS_NAME)).items()}
    tensors["vision_tower.blocks.0.attn.qkv.weight"] = torch.ones(3, 3)
    tensors["mm_projector.linear_1.weight"] = torch.ones(2, 2)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    loaded = load_pretrained(tmp_path)
    _assert_same_model(model, loaded, tokens)
    listed = ["mm_projector.linear_1.weight", "vision_tower.blocks.0.attn.qkv.weight"]
    assert CheckpointFiles.open(tmp_path).skipped == listed and loaded.loading.skipped_tensors == listed


@pytest.mark.parametrize(
    "change, words",
    [
        # FP8 weights with their scales (DeepSeek-V3 style)
        (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].to(
            torch.float8_e4m3fn), "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1)}),
         ["quantised", "F8_E4M3", "model.layers.0.mlp.up_proj.weight", "weight_scale_inv"]),
        # MXFP4-packed experts: *_blocks (U8) and *_scales
        (lambda t: t.update({"model.layers.1.block_sparse_moe.experts.gate_up_proj_blocks": torch.zeros(
            4, 2, 8, dtype=torch.uint8), "model.layers.1.block_sparse_moe.experts.gate_up_proj_scales": torch.zeros(
            4, 2, dtype=torch.uint8)}), ["quantised", "U8", "gate_up_proj_blocks", "gate_up_proj_scales"]),
        # int8 weight in place of a float one
        (lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}),
         ["quantised", "I8", "model.norm.weight"]),
    ],
)  # fmt: skip
def test_quantised_tensors_are_refused_by_name(bad, change, words):
    _rewrite(bad, change)
    _load_fails(bad, *words)


def test_quantization_config_is_refused(bad):
    _edit_config(bad, quantization_config={"quant_method": "fp8"})
    # a k3lab config has no such field: the config itself is refused first
    _load_fails(bad, "quantization_config")


def test_hf_quantization_config_is_refused(tmp_path):
    folder = tmp_path / "q"
    model = _varied_nano(kda_gate="softplus", kda_output_gate="low_rank", mla_output_gate=False, residual="plain",
                         hidden_act="swiglu", routed_expert_hidden_size=None)  # fmt: skip
    model.save_pretrained(folder)
    _edit_config(folder, quantization_config={"quant_method": "mxfp4"})
    _load_fails(folder, "quantised checkpoint", "mxfp4")


def test_nan_found_while_streaming_names_file_and_tensor(bad):
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"

    def poison(t):
        t[key][0, 0] = float("nan")

    _rewrite(bad, poison)
    _load_fails(bad, "NaN or Inf", key, WEIGHTS_NAME)


def test_meta_build_reads_each_tensor_once(saved):
    from k3core.loading.folder import CheckpointFiles
    from k3core.loading.into_parameters import materialise, stream_weights

    files = CheckpointFiles.open(saved[1])
    model = materialise(K3ForCausalLM.from_config(files.config, device="meta"), "cpu")
    stream_weights(model, files)
    assert files.bytes_read == files.bytes_total == (saved[1] / WEIGHTS_NAME).stat().st_size - 8 - int.from_bytes(
        (saved[1] / WEIGHTS_NAME).read_bytes()[:8], "little")  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_published_shapes_match_the_state_dict(tied):
    from k3core.loading.into_parameters import published_tensors
    from k3core.loading.pretrained import published_shapes

    model = K3ForCausalLM.from_config(from_preset("k3-nano", tie_word_embeddings=tied), device="meta")
    want = {k: tuple(v.shape) for k, v in published_tensors(model).items()}
    assert published_shapes(model) == want


def _file_mapped_at(ptr: int) -> str | None:
    """The file mapped at address ``ptr`` in this process (Linux /proc/self/maps), or None."""
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= ptr < end:
            return parts[5] if len(parts) == 6 else None
    return None


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_zero_copy_parameters_are_private_maps_of_the_file(saved, tokens):
    """Large tensors stored in the parameter's dtype are mapped, not copied; writes never reach the file."""
    model, path = saved
    loaded = load_pretrained(path)
    emb = loaded.model.embed_tokens.weight  # 256 x 64 fp32 = 64 KiB: mapped
    assert (_file_mapped_at(emb.data_ptr()) or "").endswith(WEIGHTS_NAME)
    small = loaded.model.norm.weight  # 256 bytes: read into its own memory
    assert _file_mapped_at(small.data_ptr()) is None or not _file_mapped_at(small.data_ptr()).endswith(WEIGHTS_NAME)
    before = (path / WEIGHTS_NAME).read_bytes()
    with torch.no_grad():
        emb.add_(1.0)  # copy-on-write: this process only
    assert (path / WEIGHTS_NAME).read_bytes() == before
    assert torch.equal(emb, model.model.embed_tokens.weight + 1.0)
    _assert_same_model(model, load_pretrained(path), tokens)
    # a copy loaded the other way round is the same model
    from k3core.loading.folder import CheckpointFiles
    from k3core.loading.into_parameters import materialise, stream_weights
    from k3core.loading.pretrained import build_meta_model

    files = CheckpointFiles.open(path)
    copied = materialise(build_meta_model(K3ForCausalLM, files.config, None), "cpu")
    stream_weights(copied, files, zero_copy=False)
    assert _file_mapped_at(copied.model.embed_tokens.weight.data_ptr()) is None or not _file_mapped_at(
        copied.model.embed_tokens.weight.data_ptr()).endswith(WEIGHTS_NAME)  # fmt: skip
    _assert_same_model(model, copied.eval(), tokens)


_PEAK_CHILD = """
import sys, torch
from k3core.modeling.model import K3ForCausalLM
def status(key):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key))
torch.ones(1) + 1  # torch's own lazy allocations before the baseline
base = status("VmRSS:")
model = K3ForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
print(status("VmHWM:") - base)
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs /proc/self/status")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_host_memory_is_about_the_model(tmp_path, dtype):
    """Streaming: the load adds the model's bytes plus about one tensor per reading thread, not 2-3 models
    (the old loader built a random fp32 model, then read every tensor, then copied)."""
    import subprocess
    import sys

    cfg = from_preset("k3-nano", vocab_size=16384, hidden_size=512, intermediate_size=2048, num_experts=0,
                               kda_num_heads=4, kda_head_dim=64, num_attention_heads=4, residual="plain")  # fmt: skip
    torch.manual_seed(0)
    K3ForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model_bytes = K3ForCausalLM.plan_placement(cfg, device="cpu", dtype=getattr(torch, dtype)).total_bytes
    largest = 16384 * 512 * 4  # the embedding / LM head, fp32 in the file
    env = {**__import__("os").environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[3])}
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(tmp_path), dtype], capture_output=True, text=True,
                         env=env, check=True)  # fmt: skip
    added = int(out.stdout.strip().splitlines()[-1])
    assert model_bytes > 60 * 2**20
    assert added < model_bytes + 2 * largest + 16 * 2**20, (added, model_bytes)
