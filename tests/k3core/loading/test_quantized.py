"""Quantised checkpoints (k3core.loading.quantized): compressed-tensors' own compressor writes them, k3lab reads
them.

- MXFP4 (the published Kimi K3's experts): k3lab's decoder equals compressed-tensors' decompression bit for bit,
  and a small Kimi Linear model whose experts compressed-tensors quantised loads with exactly those weights and
  the logits of transformers running the dequantised dense checkpoint (transformers cannot load the quantised
  one: its fused experts are not the Linear modules compressed-tensors decompresses);
- pack-quantized INT4 (group-wise, symmetric and asymmetric) and FP8 / INT8 weights decode as compressed-tensors
  decompresses them;
- anything else, and broken files, are clear errors naming format, file and tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3core.loading.folder import CheckpointFiles
from k3core.loading.pretrained import load_pretrained
from k3core.loading.quantized import mxfp4_to_float
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.model import K3ForCausalLM
from tests.k3core.test_hf_kimi_linear import ids, kimi_linear_type, perturb, relative_difference

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

MXFP4_ARGS = dict(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)
SCHEMES = {
    "mxfp4-pack-quantized": (MXFP4PackedCompressor, MXFP4_ARGS),
    "pack-quantized": (PackedQuantizationCompressor, dict(num_bits=4, type="int", strategy="group", group_size=16)),
    "pack-quantized-asym": (
        PackedQuantizationCompressor,
        dict(num_bits=4, type="int", strategy="group", group_size=16, symmetric=False),
    ),
    "float-quantized": (NaiveQuantizationCompressor, dict(num_bits=8, type="float", strategy="channel")),
    "naive-quantized": (NaiveQuantizationCompressor, dict(num_bits=8, type="int", strategy="channel")),
}


def compress(weight: torch.Tensor, kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' own quantisation of ``weight`` (scales from its calculate_qparams, packing by its
    compressor): the stored parts, and what its decompressor gives back."""
    compressor, args = SCHEMES[kind]
    qargs = QuantizationArgs(**args)
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
    if qargs.strategy == "group":
        groups = weight.reshape(weight.shape[0], -1, qargs.group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), qargs)
    else:
        scale, zero = calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), qargs)
    state = {"weight": weight, "weight_scale": scale}
    if not qargs.symmetric:
        state["weight_zero_point"] = zero.to(torch.int8)
    parts = compressor.compress(state, scheme)
    back = compressor.decompress(dict(parts), scheme)["weight"]
    return dict(parts), back


def quantization_config(kind: str, targets: list[str]) -> dict:
    _, args = SCHEMES[kind]
    fmt = kind.removesuffix("-asym")
    weights = QuantizationArgs(**args).model_dump(mode="json")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": targets, "weights": weights, "format": fmt}},
        "ignore": ["lm_head"],
    }


def quantise_folder(dense: Path, out: Path, kind: str, pattern: str) -> dict[str, torch.Tensor]:
    """Copy a saved checkpoint with every weight whose name contains ``pattern`` compressed by compressed-tensors
    (``kind``); also writes ``out``-dequantised (the same with compressed-tensors' decompressed weights).
    Returns {weight name: decompressed weight}."""
    tensors = load_file(str(dense / "model.safetensors"))
    stored, plain, decoded = {}, {}, {}
    for name, value in tensors.items():
        if pattern in name and name.endswith(".weight"):
            parts, back = compress(value, kind)
            base = name.removesuffix(".weight")
            stored.update({f"{base}.{role}": t.contiguous() for role, t in parts.items()})
            decoded[name] = back
            plain[name] = back.float()
        else:
            stored[name] = plain[name] = value
    config = json.loads((dense / "config.json").read_text())
    for folder, table, quant in ((out, stored, True), (out.with_name(out.name + "-dequantised"), plain, False)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(table, str(folder / "model.safetensors"))
        with_quant = {**config, "quantization_config": quantization_config(kind, [f"re:.*{pattern}.*"])}
        (folder / "config.json").write_text(json.dumps(with_quant if quant else config))
    return decoded


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    """A small Kimi Linear model (in-widths multiples of 32, as MXFP4 needs) saved dense."""
    cfg = kimi_linear_type(hidden_size=64, moe_intermediate_size=32, q_lora_rank=None, full_attn_layers=[2, 4])
    torch.manual_seed(3)
    model = K3ForCausalLM.from_config(cfg).eval()
    perturb(model, seed=4)
    folder = tmp_path_factory.mktemp("kimi-linear") / "dense"
    model.save_pretrained(folder)
    return folder


def test_mxfp4_decoder_is_bitwise_compressed_tensors():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=gen)
    packed[0, :16] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble, both halves
    scale = torch.randint(100, 150, (48, 4), dtype=torch.uint8, generator=gen)
    scale[1] = torch.tensor([0, 1, 126, 254], dtype=torch.uint8)  # the extremes of E8M0 that stay finite
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**MXFP4_ARGS))
    want = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]
    got = mxfp4_to_float(packed, scale, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bitwise, signed zeros included
    assert torch.equal(mxfp4_to_float(packed, scale), want.float())  # every value is exact in fp32 as well
    # by hand: byte 0x9A holds column 0 = nibble 0xA (-1.0) and column 1 = 0x9 (-0.5); scale 2^(128-127)
    one = mxfp4_to_float(torch.tensor([[0x9A] * 16], dtype=torch.uint8), torch.tensor([[128]], dtype=torch.uint8))
    assert one[0, :2].tolist() == [-2.0, -1.0]


def test_mxfp4_model_loads_with_compressed_tensors_weights_and_transformers_logits(kimi_linear, tmp_path):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    folder = tmp_path / "mxfp4"
    decoded = quantise_folder(kimi_linear, folder, "mxfp4-pack-quantized", ".experts.")
    assert len(decoded) == 3 * 3 * 4  # 3 MoE layers x 4 experts x w1, w2, w3
    files = CheckpointFiles.open(folder)
    assert set(files.bytes_by_format()) == {"MXFP4", "F32"}
    ours = K3ForCausalLM.from_pretrained(folder).eval()
    state = ours.state_dict()
    for name, want in decoded.items():
        assert want.dtype == torch.bfloat16
        assert torch.equal(state[name], want.float()), name  # bitwise
        assert torch.equal(files.read(name), want.float()), name
    # a bf16 load keeps the bits as well (every MXFP4 value is a bf16 value)
    half = K3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(half[n].view(torch.int16), w.view(torch.int16)) for n, w in decoded.items())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder.with_name("mxfp4-dequantised"), dtype=torch.float32
    ).eval()
    x = ids()
    with torch.no_grad():
        assert relative_difference(ours(x).logits, theirs(x).logits) <= 1e-5


@pytest.mark.parametrize("kind", ["pack-quantized", "pack-quantized-asym", "float-quantized", "naive-quantized"])
def test_other_compressed_tensors_formats_decode_as_compressed_tensors_does(kimi_linear, tmp_path, kind):
    folder = tmp_path / kind
    decoded = quantise_folder(kimi_linear, folder, kind, "self_attn.o_proj")
    files = CheckpointFiles.open(folder)
    fmt = {"float-quantized": "FP8", "naive-quantized": "INT8"}.get(kind, "INT4")
    assert fmt in files.bytes_by_format()
    model = load_pretrained(folder, K3ForCausalLM)
    state = model.state_dict()
    for name, want in decoded.items():
        assert torch.equal(files.read(name), want.float()), name
        assert torch.equal(state[name], want.float()), name
    dense = load_pretrained(folder.with_name(f"{kind}-dequantised"), K3ForCausalLM)
    x = ids(tokens=9)
    with torch.no_grad():
        assert torch.equal(model(x).logits, dense(x).logits)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def mxfp4_folder(kimi_linear, tmp_path_factory):
    folder = tmp_path_factory.mktemp("q") / "mxfp4"
    quantise_folder(kimi_linear, folder, "mxfp4-pack-quantized", ".experts.")
    return folder


def _rewritten(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_truncated_quantised_shard_names_file_and_tensor(mxfp4_folder, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(mxfp4_folder, folder)
    files = CheckpointFiles.open(folder)
    last = max(files.tensors.values(), key=lambda i: i.end)
    assert last.parts  # the file ends with an expert's parts (safetensors sorts U8 last)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_pretrained(folder, K3ForCausalLM)
    # a reader that opened the headers before the file was cut names the tensor it could not read
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated while reading .*weight_"):
        files.read(last.name)


def test_scale_of_the_wrong_shape_names_the_tensor(mxfp4_folder, tmp_path):
    key = "model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"

    def shrink(t):
        t[key] = t[key][:, :-1].contiguous()

    folder = _rewritten(mxfp4_folder, tmp_path / "scale", shrink)
    with pytest.raises(CheckpointError, match=r"MXFP4 scale tensor .*experts\.2\.w2\.weight_scale.* has shape"):
        CheckpointFiles.open(folder)


@pytest.mark.parametrize(
    "change, words",
    [
        # NVFP4: FP4 bytes with FP8 group scales and a global scale
        (lambda t: t.update({"model.layers.1.block_sparse_moe.experts.0.w1.weight_global_scale": torch.ones(1)}),
         ["NVFP4", "experts.0.w1.weight_packed", "experts.0.w1.weight_global_scale"]),
        # GPTQ
        (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": torch.zeros(4, 8, dtype=torch.int32),
                             "model.layers.0.mlp.up_proj.scales": torch.ones(1, 8)}),
         ["GPTQ", "up_proj.qweight", "up_proj.scales"]),
    ],
)  # fmt: skip
def test_unknown_quantisation_formats_are_named(mxfp4_folder, tmp_path, change, words):
    folder = _rewritten(mxfp4_folder, tmp_path / "odd", change)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(folder, K3ForCausalLM)
    for word in ["cannot decode", *words]:
        assert word in str(info.value), (word, str(info.value))


def test_unknown_compressed_tensors_format_in_the_config(mxfp4_folder, tmp_path):
    folder = tmp_path / "nvfp4"
    shutil.copytree(mxfp4_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'nvfp4-pack-quantized' is not supported"):
        load_pretrained(folder, K3ForCausalLM)


def test_gguf_folder_is_named(tmp_path, mxfp4_folder):
    shutil.copy(mxfp4_folder / "config.json", tmp_path / "config.json")
    (tmp_path / "kimi-k3-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(CheckpointError, match="GGUF files .*kimi-k3-Q4_K_M.gguf"):
        load_pretrained(tmp_path, K3ForCausalLM)


# ---------------------------------------------------------------------------------------------- the sample
def test_mxfp4_sample_is_k3_full_stored_as_published():
    root = Path(__file__).resolve().parents[3] / "sample_checkpoints"
    folder = root / "k3-mxfp4"
    assert (folder / "model.safetensors").stat().st_size < 4_000_000
    files = CheckpointFiles.open(folder)
    assert list(files.bytes_by_format()) == ["BF16", "MXFP4", "F32"]
    assert files.quantization["format"] == "mxfp4-pack-quantized" and files.skipped == [
        "vision_tower.patch_embed.proj.weight"
    ]
    quantised = [i for i in files.tensors.values() if i.parts]
    assert len(quantised) == 7 * 8 * 3 and all(i.name.startswith("model.layers.") for i in quantised)
    # one read per expert: its six stored tensors lie back to back
    spans = {}
    for info in quantised:
        key = info.name.rsplit(".", 3)[0]
        spans.setdefault(key, []).append((info.begin, info.end))
    for key, parts in spans.items():
        parts.sort()
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), key
    sample = K3ForCausalLM.from_pretrained(folder).eval()
    full = K3ForCausalLM.from_pretrained(root / "k3-full").eval()
    assert sample.config.to_dict() == {**full.config.to_dict(), "moe_intermediate_size": 64, "name": "k3-mxfp4"}
    # expert weights: compressed-tensors' decompression of the stored parts, bitwise; padding units are zero
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**MXFP4_ARGS))
    raw = load_file(str(folder / "model.safetensors"))
    state = sample.state_dict()
    for info in quantised[:12]:
        base = "language_model." + info.name.removesuffix(".weight")
        parts = {"weight_packed": raw[base + ".weight_packed"], "weight_scale": raw[base + ".weight_scale"]}
        want = MXFP4PackedCompressor.decompress(parts, scheme)["weight"].float()
        assert torch.equal(state[info.name], want), info.name
    w1 = sample.model.layers[1].block_sparse_moe.experts.w1
    assert w1[:, 40:].abs().max() == 0 and w1[:, :40].abs().min() >= 0
    # the same model up to MXFP4 / bf16 rounding: the same greedy next bytes on text
    x = torch.tensor([list(b"ROMEO: But soft, what light through yonder window breaks? It is the east")])
    with torch.no_grad():
        a, b = full(x).logits, sample(x).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert relative_difference(b, a) < 0.05


def test_mxfp4_expert_norms_from_stored_bytes_match_the_decoded_weights():
    from analysis import weights as wt

    folder = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-mxfp4"
    summary = wt.read_weight_summary(folder, experts=True)
    model = K3ForCausalLM.from_pretrained(folder)
    for layer, expert in ((1, 0), (4, 7), (7, 3)):
        row = summary.expert_norms.query(f"layer == {layer} and expert == {expert}").iloc[0]
        stack = model.model.layers[layer].block_sparse_moe.experts
        for w in ("w1", "w2", "w3"):
            assert row[f"{w}_norm"] == getattr(stack, w)[expert].double().norm().item()  # exact: sums of exact squares
