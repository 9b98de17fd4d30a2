"""Hostile trace folders (issue 28): every trace file goes through the checked open, npz members are bounded before
a byte is inflated, and the run card is checked against the arrays. Each input is built here (a few MB at most,
written without ever holding the inflated bytes) and gets a TraceError / CheckpointError / LibraryError naming the
file within 2 s and 200 MB of extra memory (``bounded`` from tests/repo/test_hostile_inputs.py)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
import threading
import time
import zipfile
import zlib
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from analysis.runs import loading as runs_mod
from app.library.roots import descriptor_check
from app.library.run_folders import LibraryError
from app.library.store import RunsLibrary
from k3core.interp.trace import Trace
from k3core.interp.trace_checks import MAX_TEXT_TOKENS, check_layout
from k3core.interp.trace_folder import CARD_NAME, read_trace_dir
from k3core.interp.trace_npz import MAX_INFLATE_RATIO, NpzLimits, TraceError, read_npz
from k3core.loading.tensor_info import CheckpointError
from k3core.utils.files import checked_opens
from k3lab.cli import main as k3lab
from tests.repo.test_hostile_inputs import bounded

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"
BOMB_BYTES = 3 * 1024**3  # the inflated size of the deflated member (3 GiB of zeros in about 3 MB)


def two_text_trace(root: Path) -> Path:
    """A real trace folder in ``root`` (`k3lab trace` of the k3-full sample on two short texts, 12 tokens each)."""
    texts = []
    for i, text in enumerate(("To be, or not to be.", "ROMEO: But soft!")):
        (root / f"t{i}.txt").write_text(text)
        texts += ["--text", str(root / f"t{i}.txt")]
    assert k3lab(["trace", str(SAMPLE), *texts, "--max-tokens", "12", "--out", str(root / "trace")]) == 0
    return root / "trace"


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    return two_text_trace(tmp_path_factory.mktemp("hostile-trace"))


@pytest.fixture
def copy(traced, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(traced, out)
    return out


def _card(folder: Path) -> dict:
    return json.loads((folder / CARD_NAME).read_text())


def _write_card(folder: Path, card: dict) -> None:
    (folder / CARD_NAME).write_text(json.dumps(card))


def _reseal(folder: Path, index: int = 0) -> None:
    """The card's sha256 of trace-<index>.npz made to match the file again (the attack ships a correct digest)."""
    card = _card(folder)
    card["texts"][index]["sha256"] = hashlib.sha256((folder / f"trace-{index}.npz").read_bytes()).hexdigest()
    _write_card(folder, card)


# ----------------------------------------------------------------------------------------- hand-made zips
def _npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _deflated_zeros(header: bytes, zero_bytes: int) -> bytes:
    """A raw deflate stream of ``header`` + ``zero_bytes`` zeros, built from one compressed MiB repeated (each part
    ends with a full flush, so parts are independent): 3 GiB cost 3 MB and no inflating."""

    def part(data: bytes) -> bytes:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH)

    mib = part(bytes(1 << 20))
    assert zero_bytes % (1 << 20) == 0
    return part(header) + mib * (zero_bytes >> 20) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()


def _zip(members: list[tuple[str, int, bytes, int, int]]) -> bytes:
    """A zip64 archive of (name, method, data as stored, inflated size, crc) written by hand, so a member's
    declared sizes may be anything (zipfile itself would inflate nothing it writes, but needs the bytes)."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, method, data, size, crc in members:
        offset = out.tell()
        raw = name.encode()
        extra = struct.pack("<HHQQ", 1, 16, size, len(data))
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, method, 0, 0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                              len(raw), len(extra)) + raw + extra + data)  # fmt: skip
        central.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, method, 0, 0x21, crc, 0xFFFFFFFF,
                                  0xFFFFFFFF, len(raw), len(extra), 0, 0, 0, 0, offset) + raw + extra)  # fmt: skip
    cd_offset = out.tell()
    out.write(central.getvalue())
    n = len(members)
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central.getvalue()), cd_offset, 0))
    return out.getvalue()


def _stored(name: str, array: np.ndarray) -> tuple[str, int, bytes, int, int]:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array.copy(order="C"), allow_pickle=False)  # 0-d stays 0-d
    data = buf.getvalue()
    return name, zipfile.ZIP_STORED, data, len(data), zlib.crc32(data)


def _members_of(npz: Path, drop: str | None = None) -> list[tuple[str, int, bytes, int, int]]:
    """The members of a real trace file, stored, without ``drop``."""
    with np.load(npz, allow_pickle=False) as data:
        return [_stored(f"{k}.npy", data[k]) for k in data.files if k != drop]


def _bomb_member(name: str, inflated: int) -> tuple[str, int, bytes, int, int]:
    header = _npy_header((inflated // 4,))
    data = _deflated_zeros(header, inflated)
    return name, zipfile.ZIP_DEFLATED, data, len(header) + inflated, 0  # crc never reached: refused before


def add_big_member(folder: Path, index: int, name: str, declared: int) -> int:
    """trace-<index>.npz of ``folder`` with one more array, ``name`` (axes ["x"]), declaring ``declared`` bytes of
    zeros in about ``declared / 1000`` deflated, and a stored "pad" array (axes ["y"]) of random bytes that keeps the
    file's ratio under MAX_INFLATE_RATIO (every check but the one a test aims at passes); the card resealed. Written
    without ever holding the inflated bytes. Returns the bytes the file now declares."""
    npz = folder / f"trace-{index}.npz"
    with np.load(npz, allow_pickle=False) as data:
        header = json.loads(data["__header__"].tobytes())
    header["axes"][name], header["axes"]["pad"] = ["x"], ["y"]
    members = [m for m in _members_of(npz) if m[0] != "__header__.npy"]
    pad = np.frombuffer(os.urandom(declared // (MAX_INFLATE_RATIO - 10)), dtype=np.uint8)
    members += [_stored("__header__.npy", np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)),
                _stored("a/pad.npy", pad), _bomb_member(f"a/{name}.npy", declared)]  # fmt: skip
    npz.write_bytes(_zip(members))
    _reseal(folder, index)
    return sum(m[3] for m in members)


def test_the_bomb_fixture_is_a_real_bomb():
    name, _, data, size, _ = _bomb_member("a/x.npy", BOMB_BYTES)
    assert len(data) < 4 * 1024**2 and size > BOMB_BYTES
    head = zlib.decompressobj(-15).decompress(data, 8 * 1024**2)  # the first 8 MB inflate as declared
    assert head[:6] == b"\x93NUMPY" and not any(head[256:])


# ----------------------------------------------------------------------------------------- npz bounds
def test_a_deflated_multi_gigabyte_member_is_refused_before_inflating(copy):
    (copy / "trace-0.npz").write_bytes(_zip([*_members_of(copy / "trace-0.npz", "a/hidden"),
                                             _bomb_member("a/hidden.npy", BOMB_BYTES)]))  # fmt: skip
    _reseal(copy)
    message = bounded(lambda: runs_mod.load_run(copy), CheckpointError, "trace-0.npz")
    assert "would inflate to" in message and f"limit is {MAX_INFLATE_RATIO}x" in message
    folder_message = bounded(lambda: read_trace_dir(copy), TraceError, r"copy/trace-0\.npz")
    assert "inflate" in folder_message
    # and through the upload (whose check reads the traces) and `k3lab report`
    lib = RunsLibrary(copy.parent / "home")
    bounded(lambda: lib.add_files([(p.name, p.read_bytes()) for p in copy.iterdir()], "bomb"), LibraryError, "inflate")
    assert lib.entries() == [] and list(lib.runs_dir.iterdir()) == []
    assert k3lab(["report", str(copy), "--out", str(copy.parent / "report"), "--no-static", "--quiet"]) != 0


def test_a_bomb_under_the_size_limit_but_over_the_ratio_is_refused_by_the_reader():
    data = _zip([_bomb_member("a/x.npy", 256 * 1024**2)])
    message = bounded(lambda: read_npz(io.BytesIO(data), "t.npz"), TraceError, "would inflate")
    assert "t.npz" in message


def test_the_size_limit_holds_whatever_the_ratio():
    data = _zip([_bomb_member("a/x.npy", 256 * 1024**2)])
    limits = NpzLimits(max_bytes=128 * 1024**2, max_ratio=10**9)
    bounded(lambda: read_npz(io.BytesIO(data), "t.npz", limits), TraceError, "over the limit of 134,217,728")


def test_a_zip_directory_that_understates_the_member_inflates_no_further():
    """The directory says 64 bytes of data; the stream holds 3 GiB: reading stops at the declared size."""
    header = _npy_header((16,))
    name, method, data, _, _ = _bomb_member("a/x.npy", BOMB_BYTES)
    lying = _zip([(name, method, _deflated_zeros(header, 1 << 20)[:0] + data, len(header) + 64, 0)])
    bounded(lambda: read_npz(io.BytesIO(lying), "t.npz"), TraceError, "t.npz")


def test_a_member_failing_the_layer_check_is_refused_before_it_is_inflated(copy):
    """Issue 36: a trace whose ratio and size pass, with a 1 GiB array of a layer the card's config does not have, is
    refused from its layout (names, axes, shapes), in the server's estimate and in the reader: nothing inflated."""
    add_big_member(copy, 0, "blocks.99.kda.g", 1024**3)
    run = runs_mod.load_run(copy)
    for read in (
        lambda: runs_mod.recorded_bytes(run, 0),
        lambda: runs_mod.trace_run(run, runs_mod.recorded_input(run)),
    ):
        message = bounded(read, CheckpointError, r"copy/trace-0\.npz: array 'blocks\.99\.kda\.g' is of layer 99")
    assert "card's config has" in message
    assert runs_mod.trace_run(run, runs_mod.recorded_input(run, 1)).trace is not None  # the other text reads


def test_a_text_is_estimated_from_its_directory_and_read_within_what_was_admitted(copy):
    """``recorded_bytes``: the bytes the file's members declare, from the zip directory (1 GiB declared: answered
    within 2 s and 200 MB); a read capped below what the file declares is refused before inflating."""
    declared = add_big_member(copy, 0, "extra", 1024**3)
    run = runs_mod.load_run(copy)
    start = time.perf_counter()
    assert runs_mod.recorded_bytes(run, 0) == declared > 1024**3
    assert time.perf_counter() - start < 2
    plain = runs_mod.recorded_bytes(run, 1)
    with zipfile.ZipFile(copy / "trace-1.npz") as zf:
        assert plain == sum(i.file_size for i in zf.infolist())
    small = lambda: runs_mod.trace_run(run, runs_mod.recorded_input(run, 0), max_read_bytes=256 * 1024**2)  # noqa: E731
    bounded(small, CheckpointError, "over the limit of 268,435,456 bytes")
    ctx = runs_mod.trace_run(run, runs_mod.recorded_input(run, 1), max_read_bytes=plain)  # exactly what it declares
    assert ctx.trace is not None


def test_a_huge_declared_shape_over_64_bytes_is_refused_before_allocating(copy):
    header = _npy_header((10**12,))
    member = ("a/hidden.npy", zipfile.ZIP_STORED, header + bytes(64), len(header) + 64, zlib.crc32(header + bytes(64)))
    (copy / "trace-0.npz").write_bytes(_zip([*_members_of(copy / "trace-0.npz", "a/hidden"), member]))
    _reseal(copy)
    run = runs_mod.load_run(copy)
    message = bounded(lambda: runs_mod.trace_run(run, runs_mod.recorded_input(run)), CheckpointError, "declares")
    assert "copy/trace-0.npz" in message and "(1000000000000,)" in message and "holds 64 bytes" in message


def test_object_arrays_and_unknown_members_are_refused():
    obj = _stored("a/x.npy", np.zeros(2))
    header = _npy_header((2,), "|O")
    bad = ("a/x.npy", zipfile.ZIP_STORED, header + bytes(16), len(header) + 16, zlib.crc32(header + bytes(16)))
    with pytest.raises(TraceError, match="not a plain numeric array"):
        read_npz(io.BytesIO(_zip([bad])), "t.npz")
    with pytest.raises(TraceError, match="not one array"):
        read_npz(io.BytesIO(_zip([obj, ("evil.py", 0, b"x", 1, zlib.crc32(b"x"))])), "t.npz")


def test_a_real_trace_reads_back_equal(traced):
    with np.load(traced / "trace-0.npz", allow_pickle=False) as data:
        want = {k: data[k] for k in data.files}
    got = read_npz(open(traced / "trace-0.npz", "rb"), "t")  # noqa: SIM115 - closed by zipfile
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v, equal_nan=v.dtype.kind == "f"), k


# ----------------------------------------------------------------------------------------- links
def _outside_trace(copy: Path) -> Path:
    """A genuine trace file outside the allowed folder (its content otherwise valid)."""
    outside = copy.parent / "outside"
    outside.mkdir()
    shutil.copy(copy / "trace-1.npz", outside / "secret.npz")
    return outside / "secret.npz"


LINKED = "copy/trace-1.npz: is a symbolic link"


def test_a_linked_trace_file_refuses_only_its_text_in_the_server_and_on_the_command_line(copy, tmp_path, capsys):
    """One rule (issue 36): a trace file that is a link is refused, in the server and by `k3lab report` alike; only
    its text, with one message that names the folder once; text 0 still reads."""
    secret = _outside_trace(copy)
    (copy / "trace-1.npz").unlink()
    (copy / "trace-1.npz").symlink_to(secret)
    for server in (True, False):
        with checked_opens(descriptor_check(lambda: [copy])) if server else contextlib.nullcontext():
            run = runs_mod.load_run(copy)
            assert runs_mod.trace_run(run, runs_mod.recorded_input(run, 0)).trace is not None
            text_1 = runs_mod.recorded_input(run, 1)
            message = bounded(partial(runs_mod.trace_run, run, text_1), CheckpointError, LINKED)
            assert message.count("copy/") == 1 and "copy: " not in message, message
            bounded(partial(runs_mod.recorded_bytes, run, 1), CheckpointError, LINKED)
    capsys.readouterr()
    assert k3lab(["report", str(copy), "--text-index", "1", "--out", str(tmp_path / "r1")]) != 0
    assert LINKED in capsys.readouterr().err and not (tmp_path / "r1").exists()
    assert k3lab(["report", str(copy), "--text-index", "0", "--out", str(tmp_path / "r0")]) == 0


def test_a_link_put_in_after_the_folder_was_opened_is_refused(copy):
    secret = _outside_trace(copy)
    with checked_opens(descriptor_check(lambda: [copy])):
        run = runs_mod.load_run(copy)
        (copy / "trace-1.npz").unlink()
        (copy / "trace-1.npz").symlink_to(secret)
        assert runs_mod.trace_run(run, runs_mod.recorded_input(run, 0)).trace is not None  # text 0 is fine
        bounded(lambda: run.recorded.trace(1), TraceError, LINKED)


def test_a_hard_linked_trace_file_is_refused_in_the_server_naming_it_once(copy):
    """The server's descriptor check (its CheckpointError) refuses one text, as a TraceError naming the file once."""
    os.link(copy / "trace-1.npz", copy.parent / "second-name.npz")
    with checked_opens(descriptor_check(lambda: [copy.parent])):
        run = runs_mod.load_run(copy)
        bounded(lambda: run.recorded.trace(1), TraceError, r"^copy/trace-1\.npz: has 2 hard links")
        assert run.recorded.trace(0) is not None


def test_a_link_swapped_in_after_the_folder_check_is_never_read(copy):
    """Swapping trace-0.npz between the real file and a link out, as fast as a thread can, while the page loads:
    every load returns the folder's own trace or refuses; none returns the outside file."""
    secret = _outside_trace(copy)
    real = copy / "trace-0.npz"
    genuine = copy.parent / "genuine.npz"  # outside the allowed folder too: only ever copied in
    shutil.copy(real, genuine)
    with checked_opens(descriptor_check(lambda: [copy])):
        folder = read_trace_dir(copy)
    stop = threading.Event()

    def swap() -> None:
        link = copy / ".link"
        while not stop.is_set():
            link.unlink(missing_ok=True)
            link.symlink_to(secret)
            os.replace(link, real)
            shutil.copy(genuine, copy / ".again")
            os.replace(copy / ".again", real)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    outcomes = []
    try:
        with checked_opens(descriptor_check(lambda: [copy])):
            for _ in range(20):
                try:
                    trace = folder.trace(0, verify=False)
                except (TraceError, CheckpointError) as exc:
                    outcomes.append(str(exc))
                else:
                    outcomes.append(trace["tokens"].tolist())
    finally:
        stop.set()
        swapper.join()
    secret_tokens = Trace.load(secret)["tokens"].tolist()
    assert secret_tokens not in outcomes and len(outcomes) == 20
    assert all(isinstance(o, list) or "trace-0.npz" in o for o in outcomes), outcomes


# ----------------------------------------------------------------------------------------- the card
def test_null_tokens_in_the_card_name_the_file_and_field(copy):
    card = _card(copy)
    card["texts"][0]["tokens"] = None
    _write_card(copy, card)
    message = bounded(lambda: runs_mod.load_run(copy), CheckpointError, r"run_card\.json: texts\[0\]\.tokens")
    assert "NoneType" in message


def test_a_card_of_a_million_tokens_is_refused_fast(copy):
    card = _card(copy)
    card["texts"][0]["tokens"] = [1] * 1_000_000
    card["texts"][0].pop("token_strings", None)
    _write_card(copy, card)
    message = bounded(lambda: runs_mod.load_run(copy), CheckpointError, "texts\\[0\\].tokens holds 1,000,000")
    assert f"{MAX_TEXT_TOKENS:,}" in message


def test_bad_token_ids_name_the_file(copy):
    card = _card(copy)
    card["texts"][1]["tokens"][2] = 10**9
    _write_card(copy, card)
    where = r"copy/run_card\.json: texts\[1\]\.tokens holds '1000000000'"
    bounded(lambda: runs_mod.load_run(copy), CheckpointError, where)


def test_a_card_config_of_more_layers_than_the_arrays_is_refused(copy):
    card = _card(copy)
    layers = card["config"]["num_hidden_layers"]
    card["config"]["num_hidden_layers"] = 4 * layers
    _write_card(copy, card)
    run = runs_mod.load_run(copy)
    message = bounded(lambda: runs_mod.trace_run(run, runs_mod.recorded_input(run)), CheckpointError, "cover layers")
    assert "copy/trace-0.npz" in message


def test_card_tokens_that_differ_from_the_trace_are_refused(copy):
    card = _card(copy)
    card["texts"][0]["tokens"] = card["texts"][0]["tokens"][:-1]
    card["texts"][0].pop("token_strings", None)
    _write_card(copy, card)
    run = runs_mod.load_run(copy)
    with pytest.raises(TraceError, match=r"copy/trace-0\.npz: array 'tokens' \(12 tokens\) differs"):
        run.recorded.trace(0)


def test_attention_maps_of_the_first_queries_fit_the_card_and_more_queries_than_tokens_do_not(copy):
    """The recorder keeps attention maps for the first ``max_attn_len`` queries: a text longer than that has fewer
    queries than tokens (a trace folder of a 2,100-token text was refused whole before issue 36); more is refused."""
    run = runs_mod.load_run(copy)
    entry = run.recorded.texts[0]
    with open(copy / "trace-0.npz", "rb") as fh:
        layout = Trace.layout(fh, where="t")
    maps = [name for name, axes in layout.axes.items() if "query" in axes]
    assert maps, "the fixture records attention"
    n = len(entry["tokens"])
    for queries, ok in ((n - 4, True), (n + 1, False)):
        shapes = dict(layout.shapes)
        for name in maps:
            shapes[name] = tuple(queries if a == "query" else s for a, s in zip(layout.axes[name], shapes[name]))
        if ok:
            check_layout(layout.axes, shapes, run.config, n, "t")
        else:
            with pytest.raises(TraceError, match=f"axis 'query' has {n + 1}, over the card's {n} tokens"):
                check_layout(layout.axes, shapes, run.config, n, "t")
