"""k3core.tokenizer: byte, tokenizer.json (tokenizers) and Kimi tiktoken.model tokenizers, built in the test."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from k3core.tokenizer import (
    KIMI_NUM_RESERVED_SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer,
    read_tiktoken_ranks,
    readable_bytes,
    readable_text,
    token_axis_labels,
)
from tests.conftest import nano_model

TEXTS = ["", "hello, world\n", "Grüße — naïve café ☕ 日本語 🙂", "the the  cat\t\n\nsat", "\x00\x7f"]


# ----------------------------------------------------------------------------- readable strings
def test_readable_text_and_bytes_hand_values():
    assert readable_text("a b\n\t\r") == "a␣b↵⇥␍"
    assert readable_text("\x00\u200b\xa0é") == "\\x00\\u200b\\xa0é"
    assert readable_bytes("€".encode()) == "€"
    assert readable_bytes(b"\xe2\x82") == "<0xE2><0x82>"  # the first two bytes of '€'
    assert readable_bytes(b"\xff ok") == "<0xFF>␣ok"


def test_token_axis_labels_keep_repeats_apart():
    assert token_axis_labels(["a", "a", "␣b"]) == ["0:a", "1:a", "2:␣b"]
    assert token_axis_labels(["x"], start=12) == ["12:x"]
    assert len(set(token_axis_labels(["t"] * 50))) == 50


# ----------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and tok.kind == "bytes"
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.int64)) == text
    assert tok.decode(np.array(ids, dtype=np.uint8)) == text


def test_byte_tokenizer_strings_and_range():
    tok = ByteTokenizer()
    assert tok.token_strings(tok.encode("a é\n")) == ["a", "␣", "<0xC3>", "<0xA9>", "↵"]
    assert tok.token_strings(torch.tensor([[104, 105]])) == ["h", "i"]
    assert tok.token_strings([-100, 300]) == ["<id -100>", "<id 300>"]
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    for bad in ([256], [-100]):
        with pytest.raises(ValueError, match=r"\[0, 256\)"):
            tok.decode(bad)


def test_the_byte_tokenizer_lives_in_the_tokenizer_package_only():
    import k3core.data as data

    assert not hasattr(data, "ByteTokenizer")


# ----------------------------------------------------------------------------- tokenizer.json
def _train_byte_bpe(folder: Path) -> Path:
    """A byte-level BPE (GPT-2 style) trained on a few sentences: 256 byte tokens + merges + one special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the cat sat on the mat\n", "the dog and the cat\n", "then there was the end\n"] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def bpe_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "bpe"
    folder.mkdir()
    _train_byte_bpe(folder)
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_byte_bpe_round_trip(bpe_folder, text):
    tok = load_tokenizer(bpe_folder, 512)
    assert isinstance(tok, HFTokenizer) and tok.kind == "tokenizers"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    # the pieces' bytes spell the text: readable per-token strings concatenate to the readable text
    if all(ord(c) < 128 for c in text):
        assert "".join(tok.token_strings(ids)) == readable_text(text)


def test_tokenizer_json_merges_specials_and_strings(bpe_folder):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(bpe_folder / "tokenizer.json"))
    vocab = raw.get_vocab_size()
    assert 256 < vocab <= 300
    tok = load_tokenizer(bpe_folder, vocab)
    assert tok.vocab_size == vocab
    the = raw.token_to_id("Ġthe")  # trained merge: ' the' is one token
    assert the is not None
    assert tok.encode(" the") == [the]
    eot = raw.token_to_id("<|endoftext|>")
    assert tok.special_tokens == {"<|endoftext|>": eot}
    ids = tok.encode("cat<|endoftext|>\n")
    assert eot in ids  # the special token's name in the text is the special token
    assert tok.token_strings([the, eot, raw.token_to_id("Ċ")]) == ["␣the", "<|endoftext|>", "↵"]
    assert tok.decode(ids) == "cat<|endoftext|>\n"
    with pytest.raises(ValueError, match=rf"\[0, {vocab}\)"):
        tok.decode([vocab])


def test_tokenizer_json_wordlevel_and_metaspace_byte_fallback(tmp_path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "w").mkdir()
    words.save(str(tmp_path / "w" / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "w", 8)
    assert tok.vocab_size == 3
    assert tok.encode("hello there world") == [1, 0, 2]
    assert tok.token_strings([1, 0, 2]) == ["hello", "[UNK]", "world"]

    # SentencePiece-style: '▁' marks a space, unknown characters fall back to <0xHH> byte tokens
    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "h": 5, "i": 6, "▁h": 7, "▁hi": 8}
    sp = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence(
        [decoders.Replace(Regex("▁"), " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    (tmp_path / "sp").mkdir()
    sp.save(str(tmp_path / "sp" / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "sp", 16)
    ids = tok.encode("hi\né")
    assert ids == [8, 1, 2, 3]
    assert tok.token_strings(ids) == ["␣hi", "↵", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hi\né"


# ----------------------------------------------------------------------------- tiktoken.model (Kimi)
MERGES = [b"th", b"he", b"the", b" the", b" t", "中".encode(), "中文".encode(), " 中".encode(), b"in", b"'s"]


def _write_kimi(folder: Path, merges=MERGES, added: dict | None = None) -> dict[bytes, int]:
    """tiktoken.model with all 256 bytes (ranks 0..255, in byte order) + merges, and a tokenizer_config.json."""
    ranks = {bytes([b]): b for b in range(256)}
    for m in merges:
        ranks[m] = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    if added is None:
        added = {n: "[BOS]", n + 1: "[EOS]", n + 3: "<|im_end|>"}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in added.items()},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return ranks


@pytest.fixture
def kimi_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "kimi"
    folder.mkdir()
    _write_kimi(folder)
    return folder


def test_tiktoken_kimi_bpe_hand_computed(kimi_folder):
    ranks = read_tiktoken_ranks(kimi_folder / "tiktoken.model")
    n = 256 + len(MERGES)
    assert len(ranks) == n
    tok = load_tokenizer(kimi_folder, 1024)
    assert isinstance(tok, TiktokenTokenizer) and tok.kind == "tiktoken"
    assert tok.vocab_size == n + KIMI_NUM_RESERVED_SPECIAL_TOKENS
    # 'the' -> t,h,e -> th+e (th ranks lowest) -> the; ' the' -> ' '+the -> ' the' (rank 259)
    assert tok.encode("the") == [ranks[b"the"]]
    assert tok.encode("the the") == [ranks[b"the"], ranks[b" the"]]
    assert tok.encode("it's") == [ord("i"), ord("t"), ranks[b"'s"]]
    # Kimi's pattern: a run of Han characters is its own piece, so ' 中' is never merged across the space
    assert tok.encode(" 中文x") == [32, ranks["中文".encode()], ord("x")]
    assert tok.encode(" 中") == [32, ranks["中".encode()]]


def test_tiktoken_kimi_special_tokens_and_strings(kimi_folder):
    tok = load_tokenizer(kimi_folder, 1024)
    n = 256 + len(MERGES)
    assert tok.special_tokens["[BOS]"] == n
    assert tok.special_tokens["<|im_end|>"] == n + 3
    assert tok.special_tokens[f"<|reserved_token_{n + 2}|>"] == n + 2  # unnamed slot
    text = "[BOS]the 中文 text\n<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == n and ids[-1] == n + 3
    assert tok.decode(ids) == text
    strings = tok.token_strings(ids)
    assert strings[0] == "[BOS]" and strings[-1] == "<|im_end|>"
    assert strings[1:4] == ["the", "␣", "中文"]
    assert "↵" in strings
    assert tok.token_strings([ord("\n"), 0xE4, n + 2]) == ["↵", "<0xE4>", f"<|reserved_token_{n + 2}|>"]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_tiktoken_long_whitespace_run_is_cut_and_round_trips(kimi_folder):
    tok = load_tokenizer(kimi_folder, 1024)
    text = "the" + " " * 30_000 + "end"
    assert tok.decode(tok.encode(text)) == text


def test_tiktoken_special_ids_beyond_the_reserved_block(tmp_path):
    n = 256 + len(MERGES)
    _write_kimi(tmp_path, added={n: "[BOS]", n + 300: "<|far|>"})
    tok = load_tokenizer(tmp_path, 2048)
    assert tok.vocab_size == n + 301
    assert tok.encode("<|far|>") == [n + 300]


# ----------------------------------------------------------------------------- choosing and errors
def test_load_tokenizer_choice_order(tmp_path, kimi_folder):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert isinstance(load_tokenizer(empty, 256), ByteTokenizer)
    with pytest.raises(TokenizerError, match="tokenizer.json.*tiktoken.model") as info:
        load_tokenizer(empty, 512)
    assert "empty" in str(info.value) and str(empty) not in str(info.value)  # no server paths
    with pytest.raises(TokenizerError, match="not a folder"):
        load_tokenizer(tmp_path / "missing", 256)
    # tokenizer.json wins over tiktoken.model when both are present; a tokenizer file wins over bytes at 256
    _train_byte_bpe(kimi_folder)
    assert isinstance(load_tokenizer(kimi_folder, 300), HFTokenizer)


def test_tokenizer_larger_than_the_model_is_refused(bpe_folder, kimi_folder):
    with pytest.raises(TokenizerError, match="vocab_size is 256"):
        load_tokenizer(bpe_folder, 256)
    n = 256 + len(MERGES)
    with pytest.raises(TokenizerError, match=f"ids up to {n + 255}"):
        load_tokenizer(kimi_folder, n + 255)
    assert load_tokenizer(kimi_folder, n + 256).vocab_size == n + 256


def test_bad_tokenizer_files_get_clear_errors(tmp_path):
    def folder(name: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        return path

    no_config = folder("no_config")
    _write_kimi(no_config)
    (no_config / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer_config.json"):
        load_tokenizer(no_config, 1024)

    bad_line = folder("bad_line")
    _write_kimi(bad_line)
    with open(bad_line / "tiktoken.model", "a") as f:
        f.write("not-base64!! 999\n")
    with pytest.raises(TokenizerError, match=r"line 267"):
        load_tokenizer(bad_line, 1024)

    missing_byte = folder("missing_byte")
    (missing_byte / "tiktoken.model").write_text(
        "\n".join(f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(255))
    )
    (missing_byte / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="0xFF"):
        load_tokenizer(missing_byte, 1024)

    gap = folder("gap")
    (gap / "tiktoken.model").write_text(
        "\n".join(f"{base64.b64encode(bytes([b])).decode()} {b * 2}" for b in range(256))
    )
    (gap / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="ranks must be 0..255"):
        load_tokenizer(gap, 1024)

    collide = folder("collide")
    _write_kimi(collide, added={5: "[BOS]"})
    with pytest.raises(TokenizerError, match="inside the .* BPE ranks"):
        load_tokenizer(collide, 1024)

    bad_json = folder("bad_json")
    (bad_json / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(bad_json, 1024)

    truncated = folder("truncated")
    (truncated / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(TokenizerError, match="unreadable"):
        load_tokenizer(truncated, 1024)


def test_digest_follows_the_files(tmp_path, bpe_folder):
    same = tmp_path / "same"
    same.mkdir()
    _write_kimi(same)
    other = tmp_path / "other"
    other.mkdir()
    _write_kimi(other, merges=MERGES[:-1])
    digests = {
        "a": load_tokenizer(same, 1024).digest,
        "a again": load_tokenizer(same, 1024).digest,
        "fewer merges": load_tokenizer(other, 1024).digest,
        "bpe": load_tokenizer(bpe_folder, 512).digest,
        "bytes": ByteTokenizer().digest,
    }
    assert digests["a"] == digests["a again"]
    assert len(set(digests.values())) == 4
    assert load_tokenizer(same, 1024).describe()["kind"] == "tiktoken"


# ----------------------------------------------------------------------------- a run's tokenizer
# (analysis.runs.loading)
def _save_nano(folder: Path, vocab_size: int) -> Path:
    nano_model(0, kda_chunk_size=16, vocab_size=vocab_size).save_pretrained(folder)
    return folder


def test_run_reads_text_with_its_own_tokenizer(tmp_path):
    from analysis.runs import loading as runs
    from analysis.runs import texts

    folder = _save_nano(tmp_path / "bpe-run", 512)
    _train_byte_bpe(folder)
    run = runs.load_run(folder)
    assert isinstance(run.tokenizer, HFTokenizer) and run.card["tokenizer"] == run.tokenizer.name
    sample = texts.sample_input("shakespeare", run.config, 24, tokenizer=run.tokenizer)
    expected = run.tokenizer.encode(texts.shakespeare_passage(400))[:24]
    assert sample.input_ids[0].tolist() == expected
    assert sample.text == run.tokenizer.decode(expected) and sample.text.startswith("ANTONY:")
    assert len(sample.text) > 24  # merges: more characters than tokens
    repeat = texts.sample_input("repeat", run.config, 24, tokenizer=run.tokenizer)
    assert repeat.input_ids[0].tolist() == expected[:12] * 2
    ctx = runs.trace_run(run, sample, what=["loss"])
    assert ctx.trace.meta["run"]["tokenizer"]["kind"] == "tokenizers"
    assert ctx.token_strings == run.tokenizer.token_strings(expected)
    assert "".join(ctx.token_strings) == readable_text(sample.text)  # ASCII: the pieces spell the text
    assert ctx.token_strings[6:12] == [":", "↵", "F", "r", "i", "end"]  # 'end' is a trained merge
    assert ctx.position_labels([0, 1, 99]) == ["0:A", "1:N", "99"]
    ticks = ctx.token_axis(range(24), max_ticks=8)
    assert ticks["tickvals"] == [0, 3, 6, 9, 12, 15, 18, 21] and ticks["ticktext"][1] == f"3:{ctx.token_strings[3]}"
    typed = texts.text_input("the cat sat", run.config, 8, tokenizer=run.tokenizer)
    assert typed.input_ids[0].tolist() == run.tokenizer.encode("the cat sat") and typed.text == "the cat sat"


def test_run_without_tokenizer_loads_and_refuses_text_only(tmp_path):
    from analysis.runs import loading as runs
    from analysis.runs import texts

    run = runs.load_run(_save_nano(tmp_path / "ids-only", 512))
    assert run.tokenizer is None and run.card["tokenizer"] is None
    assert any("tokenizer.json" in note for note in run.card["notes"])
    with pytest.raises(ValueError, match="vocab 512 and no tokenizer"):
        texts.sample_input("shakespeare", run.config, 32, tokenizer=run.tokenizer)
    mqar = texts.sample_input("mqar", run.config, 32, tokenizer=run.tokenizer)
    ctx = runs.trace_run(run, mqar, what=["loss"])
    assert ctx.token_strings is None and ctx.token_axis(range(4)) == {} and ctx.position_labels([3]) == ["3"]
    assert ctx.token_texts([7]) == ["7"]
    with pytest.raises(ValueError, match=f"has {256 + len(MERGES) + 256} ids, the model only 512"):
        texts.encode_text("x y", run.config, tokenizer=TiktokenTokenizer.from_folder(_kimi_in(tmp_path / "k")))


def _kimi_in(folder: Path) -> Path:
    folder.mkdir()
    _write_kimi(folder)
    return folder


def test_byte_level_run_unchanged(tmp_path):
    from analysis.runs import loading as runs
    from analysis.runs import texts

    run = runs.load_run(_save_nano(tmp_path / "bytes", 256))
    assert isinstance(run.tokenizer, ByteTokenizer)
    sample = texts.sample_input("shakespeare", run.config, 32)  # no tokenizer passed: bytes for vocab 256
    assert sample.input_ids[0].tolist() == list(texts.shakespeare_passage(32).encode())
    same = texts.sample_input("shakespeare", run.config, 32, tokenizer=run.tokenizer)
    assert torch.equal(sample.input_ids, same.input_ids)
    ctx = runs.trace_run(run, sample, what=["loss"])
    assert ctx.token_strings[:8] == ["A", "N", "T", "O", "N", "Y", ":", "↵"]


def test_cli_generate_uses_the_run_tokenizer(tmp_path, capsys):
    from k3lab.cli import main

    bpe = tmp_path / "bpe"
    bpe.mkdir()
    _train_byte_bpe(bpe)
    vocab = load_tokenizer(bpe, 512).vocab_size
    _save_nano(bpe, vocab)  # the model's vocabulary is exactly the tokenizer's: every sampled id has text
    assert main(["generate", str(bpe), "--prompt", "the cat", "--tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out) > len("the cat\n")

    assert main(["generate", str(_save_nano(tmp_path / "no-tok", 512)), "--tokens", "4"]) == 2
    assert "no tokenizer for a model with 512 token ids" in capsys.readouterr().err


def test_token_axes_show_the_run_tokens(tmp_path):
    """Figures over token positions label their ticks "position:token" and name the token in the hover."""
    from analysis.figures import degradation, kda_memory, moe
    from analysis.runs import loading as runs
    from analysis.runs import texts

    folder = _save_nano(tmp_path / "bpe-run", 512)
    _train_byte_bpe(folder)
    run = runs.load_run(folder)
    sample = texts.sample_input("shakespeare", run.config, 40, tokenizer=run.tokenizer)
    ctx = runs.trace_run(run, sample, what="all")
    strings = run.tokenizer.token_strings(sample.input_ids[0])
    assert strings[:8] == ["A", "N", "T", "O", "N", "Y", ":", "↵"]

    fig, _ = degradation.build_entropy_by_position(ctx)
    axis = fig.layout.xaxis
    assert list(axis.tickvals) == list(range(1, 40))  # query 0 has no entropy; 39 ticks: every one labelled
    assert list(axis.ticktext) == [f"{i}:{strings[i]}" for i in range(1, 40)]
    line = next(t for t in fig.data if t.name.startswith("MLA layer"))  # the first trace is the null reference
    assert line.text[6] == "7:↵"
    fig, table = degradation.build_sink_profile(ctx)
    assert list(fig.data[0].customdata[0][:2]) == ["0:A", "1:N"]
    fig, _ = kda_memory.build_kda_state_norm(ctx)
    tick = int(fig.layout.xaxis.tickvals[0])  # a chunk end after `tick` tokens: named by the last one read
    assert fig.layout.xaxis.ticktext[0] == f"{tick - 1}:{strings[tick - 1]}"
    fig, table = moe.build_latent_pca(ctx)
    first = table[table["layer"] == table["layer"].iloc[0]]
    shown = [t for trace in fig.data if trace.visible is not False for t in trace.text]
    assert sorted(shown) == sorted(run.tokenizer.token_strings(first["token_id"]))

    # without a tokenizer (ids only) the same figures keep plotly's numeric ticks and numbers in the hover
    bare = runs.trace_run(runs.run_from_model(run.model), sample, what="all")
    bare.tokenizer = None
    fig, _ = degradation.build_entropy_by_position(bare)
    line = next(t for t in fig.data if t.name.startswith("MLA layer"))
    assert fig.layout.xaxis.ticktext is None and line.text[6] == "7"


def test_app_reads_and_writes_with_the_run_tokenizer(tmp_path, monkeypatch):
    """The app on a run with a tokenizer.json: Overview lists the input tokens, Generate decodes with it."""
    from streamlit.testing.v1 import AppTest

    from app.library import run_list
    from app.server.settings import HOME_ENV

    run = tmp_path / "bpe-run"
    run.mkdir()
    _train_byte_bpe(run)
    _save_nano(run, load_tokenizer(run, 512).vocab_size)  # every sampled id has text
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(run_list.RUNS_ENV, str(run))
    (tmp_path / "no-samples").mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", tmp_path / "no-samples")
    at = AppTest.from_file(str(Path(__file__).resolve().parents[3] / "app" / "main.py"), default_timeout=180)
    at.session_state["k3lab_max_tokens"] = 24
    at.session_state["k3lab_overview_input_tokens"] = True  # the expander, opened (its tokens are built when open)
    at.run()
    assert not at.exception and [e.value for e in at.error] == []
    tokens = [e for e in at.expander if e.label.startswith("Input tokens (tokenizer.json")]
    assert tokens and tokens[0].code[0].value.startswith("0:A 1:N 2:T 3:O 4:N 5:Y 6:: 7:↵ 8:F 9:r 10:i 11:end")

    at.switch_page("page_scripts/generate.py").run()
    at.text_area(key="k3lab_prompt").input("the cat")
    at.slider(key="k3lab_gen_tokens").set_value(6)
    at.button[0].click().run()
    assert not at.exception and [e.value for e in at.error] == []
    assert any("Tokenizer: tokenizer.json" in c.value for c in at.caption)
    assert [m.value for m in at.metric if m.label == "New tokens"] == ["6"]
    assert at.code[-1].value.startswith("the cat")


def test_report_lists_the_input_tokens(tmp_path):
    from k3lab import report

    folder = _save_nano(tmp_path / "bpe-run", 512)
    _train_byte_bpe(folder)
    out = tmp_path / "rep"
    argv = [str(folder), "--out", str(out), "--no-static", "--max-tokens", "16", "--views", "history", "--quiet"]
    assert report.main(argv) == 0
    page = (out / "report.html").read_text()
    assert "input tokens (tokenizer.json" in page and "0:A 1:N 2:T 3:O 4:N 5:Y 6:: 7:↵ 8:F 9:r 10:i 11:end" in page
