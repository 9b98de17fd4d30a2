"""Hostile inputs (issue 14): every upload, folder, header, config, tokenizer and link fails fast, bounded and clean.

Each input is built here, a few KB to a few MB, and was found to make the server allocate gigabytes, hang or
crash. Each one now gets the project's own error with a clear message within LIMIT_S seconds and LIMIT_BYTES of
extra memory (``bounded``: wall time, the process's RSS sampled during the call and its high-water mark, and
tracemalloc's peak in a second call), and an upload of it leaves nothing in the runs library, whose next use
works. The app-level cases (a page per input, the server surviving) are in tests/app/test_app_hostile.py and, in a
real browser, tests/app/test_browser_hostile.py.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import psutil
import pytest
import torch

from analysis.runs.texts import count_tokens
from app.library.roots import PathRefused, confine_folder, descriptor_check
from app.library.run_folders import LibraryError, describe_folder
from app.library.safe_zip import ZipRefused, extract_run_zip
from app.library.store import RunsLibrary
from k3core.loading.folder import CheckpointFiles, folder_fingerprint, read_config
from k3core.loading.safetensors_header import MAX_DIMS, read_safetensors_header
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.config import LIMITS
from k3core.modeling.model import K3ForCausalLM
from k3core.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from k3core.tokenizer.kimi_tiktoken import TiktokenTokenizer
from k3core.utils.files import checked_opens

LIMIT_S = 2.0
LIMIT_BYTES = 200 * 1024**2
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------- measuring
def bounded(fn, error: type[BaseException], match: str) -> str:
    """Call ``fn``, which must raise ``error`` (message matching ``match``) within LIMIT_S seconds and LIMIT_BYTES
    of extra memory (``match`` is required and must not be empty: an empty pattern matches every message). RSS
    sampled every 2 ms and the process's high-water mark around a timed call, then tracemalloc's peak around a
    second call (Python allocations the sampler may miss). Returns the message."""
    assert match, "bounded() needs the message it expects: an empty pattern matches every message"
    proc = psutil.Process()
    base = proc.memory_info().rss
    high_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        with pytest.raises(error, match=match) as info:
            fn()
    finally:
        seconds = time.perf_counter() - start
        stop.set()
        sampler.join()
    high_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_extra = max(peak[0], proc.memory_info().rss) - base
    tracemalloc.start()
    try:
        with pytest.raises(error):
            fn()
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < LIMIT_S, f"{seconds:.2f} s for {info.value}"
    assert rss_extra < LIMIT_BYTES, f"RSS +{rss_extra / 2**20:.0f} MB"
    assert high_after - max(high_before, base) < LIMIT_BYTES, "the process's peak RSS grew"
    assert python_peak < LIMIT_BYTES, f"Python peak {python_peak / 2**20:.0f} MB"
    return str(info.value)


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return K3ForCausalLM.from_config("k3-nano").save_pretrained(tmp_path_factory.mktemp("hostile") / "nano")


def _copy(nano: Path, dest: Path) -> Path:
    shutil.copytree(nano, dest)
    return dest


def write_safetensors(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    """A safetensors file from a raw header (dict or bytes): 8-byte length, the header, the data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.fixture
def library(tmp_path) -> RunsLibrary:
    return RunsLibrary(tmp_path / "home")


def assert_nothing_left(lib: RunsLibrary) -> None:
    """No entry, no stored files and no staging folder of a refused upload; the next add works."""
    assert lib.entries() == []
    assert list(lib.runs_dir.iterdir()) == []
    assert list(lib.tmp_dir.iterdir()) == []


def upload(lib: RunsLibrary, folder: Path) -> tuple:
    return lib.add_files([(p.name, p.read_bytes()) for p in sorted(folder.iterdir())], name="hostile")


def next_add_works(lib: RunsLibrary, nano: Path) -> None:
    entry, _ = upload(lib, nano)
    assert entry.name == "hostile" and (entry.path / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------- headers
def _long_shape_header() -> dict:
    # 700,000 dimensions of 2 in 2.1 MB: multiplying them out took 13 s before shapes were bounded (4.3 MB: 53 s)
    return {"w": {"dtype": "F32", "shape": [2] * 700_000, "data_offsets": [0, 4]}}


def _huge_int_header() -> bytes:
    # 8 dimensions of 4,000 digits per tensor, 150 tensors (4.8 MB): each product a 32,000-digit number
    big = "9" * 4000
    entries = ", ".join(
        f'"t{i}": {{"dtype": "F32", "shape": [{", ".join([big] * 8)}], "data_offsets": [0, 4]}}' for i in range(150)
    )
    return ("{" + entries + "}").encode()


HEADERS = {
    "long shape": (_long_shape_header, "dimension"),
    "thousands of digits": (_huge_int_header, "dimension"),
    "over 4,300 digits": (
        lambda: b'{"w": {"dtype": "F32", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 4]}}',
        "digits",
    ),
    "nine dimensions": (
        lambda: {"w": {"dtype": "F32", "shape": [1] * (MAX_DIMS + 1), "data_offsets": [0, 4]}},
        "dimension",
    ),
    "dimension of 2**63": (lambda: {"w": {"dtype": "U8", "shape": [2**63], "data_offsets": [0, 4]}}, "dimension"),
    "bytes != shape x dtype": (
        lambda: {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4]}},
        "4,000,000",
    ),
    "unknown dtype": (
        lambda: {"w": {"dtype": "X](http://evil/)", "shape": [1], "data_offsets": [0, 4]}},
        "unknown dtype",
    ),
    "nested 100,000 deep": (lambda: b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "NaN shape": (lambda: b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', "NaN"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_hostile_safetensors_headers_fail_fast(case, nano, tmp_path, library):
    build, match = HEADERS[case]
    folder = _copy(nano, tmp_path / "run")
    write_safetensors(folder / "model.safetensors", build(), b"\0" * 4)
    bounded(lambda: read_safetensors_header(folder / "model.safetensors"), CheckpointError, match)
    bounded(lambda: describe_folder(folder, label="mine"), LibraryError, match)  # "Check the folder"
    bounded(lambda: upload(library, folder), LibraryError, match)
    assert_nothing_left(library)
    next_add_works(library, nano)


def test_parameter_counting_is_linear_in_the_header(tmp_path):
    """Headers of many 8-dimensional shapes are legal; reading and counting them stays linear in their number
    (before the bounds, one long shape of 2s cost time quadratic in the header's size)."""

    def header_file(n: int) -> Path:
        dims = [2**10] * 4 + [1] * (MAX_DIMS - 4)  # 2**40 bytes each, all the same bytes of one sparse file
        header = {f"t{i}": {"dtype": "U8", "shape": dims, "data_offsets": [0, 2**40]} for i in range(n)}
        path = tmp_path / f"h{n}.safetensors"
        raw = json.dumps(header).encode()
        with open(path, "wb") as fh:  # a sparse file: the declared bytes are not written
            fh.write(len(raw).to_bytes(8, "little") + raw)
            fh.truncate(8 + len(raw) + 2**40)
        return path

    def best_seconds(path: Path, n: int) -> float:
        times = []
        for _ in range(3):  # best of three: the machine is shared
            start = time.perf_counter()
            assert CheckpointFiles.open(path, require_config=False).num_parameters == n * 2**40
            times.append(time.perf_counter() - start)
        return min(times)

    small, large = best_seconds(header_file(2_000), 2_000), best_seconds(header_file(20_000), 20_000)
    assert large < LIMIT_S and large < 40 * small  # 10x the entries: about 10x the time, never 100x


# ----------------------------------------------------------------------------------------- config.json
def _hf_config() -> dict:
    from tests.k3core.modeling.test_hf_config import kimi_linear_hf_dict

    return kimi_linear_hf_dict()


def _own(**changes) -> dict:
    from k3core.modeling.presets import from_preset

    data = from_preset("k3-nano").to_dict()
    data.update(changes)
    return data


CONFIGS = {
    "20,000 layers": (lambda: json.dumps(_own(num_hidden_layers=20_000)), "20,000 is over"),
    "20,000 layers (Hugging Face)": (lambda: json.dumps({**_hf_config(), "num_hidden_layers": 20_000}), "over"),
    "10**12 layers, no layer list": (
        lambda: json.dumps({**_hf_config(), "num_hidden_layers": 10**12, "linear_attn_config": {}}),
        "over",
    ),
    "nested 100,000 deep": (lambda: '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "5,000-digit integer": (lambda: '{"num_hidden_layers": ' + "9" * 5000 + "}", "digits"),
    "Infinity layers": (lambda: json.dumps(_own(num_hidden_layers=float("inf"))), "Infinity"),
    "1e999 layers": (
        lambda: json.dumps(_own()).replace('"num_hidden_layers": 4', '"num_hidden_layers": 1e999'),
        "1e999",
    ),
    "vocab_size 10**18": (lambda: json.dumps(_own(vocab_size=10**18)), "vocab_size"),
    "hidden_size 10**30": (lambda: json.dumps(_own(hidden_size=10**30)), "digits"),
    "hidden_size 10**30 (Hugging Face, as text)": (
        lambda: json.dumps({**_hf_config(), "hidden_size": str(10**30)}),
        "hidden_size",
    ),
    "100,000 experts": (lambda: json.dumps(_own(num_experts=100_000)), "num_experts"),
    "1 MB name": (lambda: json.dumps(_own(name="x" * 2**20)), "name"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_hostile_config_json_fails_fast(case, nano, tmp_path, library):
    build, match = CONFIGS[case]
    folder = _copy(nano, tmp_path / "run")
    (folder / "config.json").write_text(build())
    bounded(lambda: read_config(folder), CheckpointError, match)
    # the placement plan (memory per device) is made from config.json before anything loads: 62 s and 2.1 GB
    # for 20,000 layers before the limits
    bounded(lambda: K3ForCausalLM.plan_placement(folder, "cpu"), CheckpointError, match)
    bounded(lambda: upload(library, folder), LibraryError, match)
    assert_nothing_left(library)
    next_add_works(library, nano)


def test_config_limits_admit_the_published_architectures():
    from k3core.modeling.presets import PRESETS, from_preset

    for name in PRESETS:
        cfg = from_preset(name)
        assert cfg.num_hidden_layers <= LIMITS["num_hidden_layers"] and cfg.num_experts <= LIMITS["num_experts"]
    assert read_config  # the presets include kimi-k3 (93 layers, 896 experts) and kimi-linear-48b


# ----------------------------------------------------------------------------------------- pickles
def _deflated_pickle(path: Path, numel: int) -> Path:
    """torch.save's zip with every entry deflated: a tensor of zeros shrinks to a few hundred KB."""
    plain = path.with_suffix(".plain")
    torch.save({"model.embed_tokens.weight": torch.zeros(numel)}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst:
        for info in src.infolist():
            with src.open(info) as fin, dst.open(info.filename, "w") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
    plain.unlink()
    return path


def test_deflated_pickle_is_refused_before_torch_load(nano, tmp_path, library):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(nano / "config.json", folder / "config.json")
    bomb = _deflated_pickle(folder / "pytorch_model.bin", 50_000_000)  # 200 MB of float32 zeros
    assert bomb.stat().st_size < 2 * 1024**2
    bounded(lambda: CheckpointFiles.open(folder), CheckpointError, "compressed")
    bounded(lambda: upload(library, folder), LibraryError, "compressed")
    assert_nothing_left(library)
    next_add_works(library, nano)


def test_old_pickle_format_is_refused_and_stored_zip_pickles_still_load(nano, tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(nano / "config.json", legacy / "config.json")
    torch.save({"w": torch.zeros(2)}, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    bounded(lambda: CheckpointFiles.open(legacy), CheckpointError, "not a torch.save zip")

    good = tmp_path / "good"
    good.mkdir()
    shutil.copy(nano / "config.json", good / "config.json")
    state = {k: v.clone() for k, v in K3ForCausalLM.from_pretrained(nano).state_dict().items()}
    torch.save(state, good / "pytorch_model.bin")
    files = CheckpointFiles.open(good)
    assert files.num_parameters == CheckpointFiles.open(nano).num_parameters


# ----------------------------------------------------------------------------------------- tokenizers
def _tiktoken_files(folder: Path, added: dict[str, dict]) -> Path:
    import base64

    (folder / "tiktoken.model").write_text(
        "\n".join(f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)) + "\n"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    return folder


def test_tiktoken_special_id_far_outside_the_vocabulary_is_refused_before_building(nano, tmp_path, library):
    folder = _copy(nano, tmp_path / "run")  # vocab 256: 256 byte ranks fill it
    _tiktoken_files(folder, {"1000000": {"content": "<|far|>"}})
    assert sum(p.stat().st_size for p in folder.glob("t*")) < 4096
    bounded(lambda: load_tokenizer(folder, 256), TokenizerError, "ids up to 1,000,000")
    bounded(lambda: TiktokenTokenizer.from_folder(folder), TokenizerError, "at most")  # no model to bound it
    bounded(lambda: upload(library, folder), LibraryError, "ids up to 1,000,000")
    assert_nothing_left(library)
    next_add_works(library, nano)


def test_tiktoken_hostile_config_under_a_memory_cap_does_not_abort_the_process(tmp_path):
    """tiktoken built a million special tokens and aborted the whole process (SIGABRT) under a memory cap:
    a fresh interpreter with 1.5 GB of address space now gets a TokenizerError and exits normally."""
    folder = _tiktoken_files(tmp_path, {"1000000": {"content": "<|far|>"}, "300": {"content": "<|x|>"}})
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1536 * 2**20, 1536 * 2**20))\n"
        "from k3core.tokenizer import TokenizerError, load_tokenizer\n"
        "try:\n"
        f"    load_tokenizer({str(folder)!r}, 512)\n"
        "except TokenizerError as exc:\n"
        "    print('refused:', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "refused:" in proc.stdout and "ids up to 1,000,000" in proc.stdout


# ----------------------------------------------------------------------------------------- zips
def _zip_of_zeros(path: Path, n: int, entry_bytes: int = 1 << 20) -> Path:
    """``n`` shard-named entries of zeros, each at most 1 MiB so that no single entry trips the ratio check.

    Written by hand from one deflated block (zipfile would deflate every entry again: seconds for n = 2000)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = packer.compress(b"\0" * entry_bytes) + packer.flush()
    crc = zlib.crc32(b"\0" * entry_bytes)
    local, central = bytearray(), bytearray()
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors".encode()
        fields = struct.pack("<HHHHHIII", 20, 0, 8, 0, 0, crc, len(block), entry_bytes)
        central += b"PK\x01\x02" + struct.pack("<H", 20) + fields
        central += struct.pack("<HHHHHII", len(name), 0, 0, 0, 0, 0o100644 << 16, len(local)) + name
        local += b"PK\x03\x04" + fields + struct.pack("<HH", len(name), 0) + name + block
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(central), len(local), 0)
    path.write_bytes(bytes(local + central) + end)
    with zipfile.ZipFile(path) as check:  # a valid archive, as zipfile reads it
        assert len(check.infolist()) == n and check.read(check.infolist()[-1]) == b"\0" * entry_bytes
    return path


@pytest.mark.parametrize("n", [40, 2000])
def test_zip_of_many_small_bombs_is_refused_before_writing(n, tmp_path, library, nano):
    archive = _zip_of_zeros(tmp_path / "bomb.zip", n)
    dest = tmp_path / "dest"
    message = bounded(
        lambda: extract_run_zip(archive, dest, max_total_bytes=8 * 1024**3), ZipRefused, "compressed size"
    )
    assert "zip bomb" in message
    assert not dest.exists() or list(dest.iterdir()) == []  # nothing written (before: 2 GiB for n = 2000)
    bounded(lambda: library.add_zip(archive.read_bytes(), "bomb"), LibraryError, "zip bomb")
    assert_nothing_left(library)
    next_add_works(library, nano)


def test_zip_entries_claiming_more_than_the_archive_are_refused(tmp_path):
    archive = _zip_of_zeros(tmp_path / "liar.zip", 3, 4096)
    data = bytearray(archive.read_bytes())
    # raise every central-directory compressed size to 1 GB: the entries then claim more than the archive
    cd = data.find(b"PK\x01\x02")
    while cd != -1:
        data[cd + 20 : cd + 24] = (10**9).to_bytes(4, "little")
        cd = data.find(b"PK\x01\x02", cd + 4)
    archive.write_bytes(bytes(data))
    bounded(lambda: extract_run_zip(archive, tmp_path / "d", max_total_bytes=8 * 1024**3), ZipRefused, "claim")


# ----------------------------------------------------------------------------------------- the library
def test_damaged_index_is_a_library_error_and_a_restart_rebuilds_it(library, nano):
    upload(library, nano)
    library.db_path.write_bytes(b"this is not an SQLite database" * 100)
    message = bounded(library.entries, LibraryError, "library.sqlite")
    assert str(library.home) not in message
    bounded(lambda: upload(library, nano), LibraryError, "library.sqlite")
    assert list(library.tmp_dir.iterdir()) == []
    fresh = RunsLibrary(library.home)  # what the message says to do: restart (the index is rebuilt)
    assert [e.name for e in fresh.entries()] == ["hostile"]  # the run stored before the damage is still there
    entry, _ = upload(fresh, nano)
    assert entry.name == "hostile-2" and (entry.path / "model.safetensors").is_file()


def test_bad_summary_row_and_deleted_tmp_folder(library, nano):
    entry, _ = upload(library, nano)
    with sqlite3.connect(library.db_path) as con:
        con.execute("UPDATE runs SET config_summary = '{not json', size_bytes = 'many' WHERE id = ?", (entry.id,))
    [shown] = library.entries()
    assert (shown.name, shown.summary, shown.size_bytes) == ("hostile", {}, 0)
    from app.library.run_folders import summary_text

    assert (
        summary_text({"layers": "x](http://evil)", "vocab_size": "lots"}) == "? layers · width ? · vocab ? · ? params"
    )
    shutil.rmtree(library.tmp_dir)  # removed while the app runs
    again, _ = library.add_files([(p.name, p.read_bytes()) for p in sorted(nano.iterdir())], name="again")
    assert again.name == "again"


_ADD_SAME_FOLDER = """
import sys, time
from pathlib import Path
from app.library.store import RunsLibrary
home, folder, go = sys.argv[1:]
lib = RunsLibrary(home)
while not Path(go).exists():
    time.sleep(0.001)
print(lib.add_path(folder).id)
"""


def test_two_processes_adding_the_same_folder_get_one_entry(tmp_path, nano):
    home = tmp_path / "home"
    RunsLibrary(home)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ADD_SAME_FOLDER, str(home), str(nano), str(go)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / "home" / "library.sqlite").exists() for _ in [0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    ids = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert ids[0] == ids[1] and len(RunsLibrary(home).entries()) == 1


def test_hard_link_to_an_outside_file_is_refused(tmp_path, nano):
    root = tmp_path / "root"
    folder = _copy(nano, root / "run")
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"secret": True}))
    (folder / "tokenizer_config.json").unlink(missing_ok=True)
    os.link(outside, folder / "tokenizer_config.json")  # same inode as a file outside the root
    with pytest.raises(PathRefused, match="hard links"):
        confine_folder(folder, [root])
    # and at open time, on the descriptor, even if the link appears after the folder was checked
    (folder / "tokenizer_config.json").unlink()
    confine_folder(folder, [root])
    os.link(outside, folder / "tokenizer_config.json")
    with checked_opens(descriptor_check(lambda: [root])):
        bounded(lambda: (CheckpointFiles.open(folder), folder_fingerprint(folder)), CheckpointError, "hard links")


def test_symlink_swapped_in_after_the_check_is_refused_at_open(tmp_path, nano):
    root = tmp_path / "root"
    folder = _copy(nano, root / "run")
    confine_folder(folder, [root])
    outside = _copy(nano, tmp_path / "outside")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside / "config.json")  # swapped in after the check
    with checked_opens(descriptor_check(lambda: [root])):
        bounded(lambda: read_config(folder), CheckpointError, "outside the folders")
    with checked_opens(descriptor_check(lambda: [root, tmp_path / "outside"])):
        assert read_config(folder).num_hidden_layers == 4  # a link inside the readable folders is fine


# ----------------------------------------------------------------------------------------- texts
def test_long_text_is_counted_without_tokenizing_it_whole():
    text = "to be or not to be " * (100 * 2**20 // 19)  # 100 MB
    start = time.perf_counter()
    tracemalloc.start()
    try:
        n, exact = count_tokens(text, ByteTokenizer())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - start
    assert not exact and abs(n - len(text)) <= 1  # bytes: one token per character of this text
    assert seconds < LIMIT_S and peak < LIMIT_BYTES, (seconds, peak / 2**20)
    assert count_tokens("to be", ByteTokenizer()) == (5, True)
