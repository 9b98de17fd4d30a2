"""app.library.safe_zip: a run zip is unpacked only when nothing in it can escape, link, nest or explode."""

from __future__ import annotations

import io
import stat
import zipfile

import pytest

from app.library.safe_zip import ZipRefused, extract_run_zip

LIMIT = 10 * 1024**2


def _zip(entries: dict[str, bytes], compression=zipfile.ZIP_STORED) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    buf.seek(0)
    return buf


def _info_zip(info: zipfile.ZipInfo, data: bytes) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(info, data)
    buf.seek(0)
    return buf


def test_flat_zip_unpacks_and_skips_junk(tmp_path):
    src = _zip(
        {
            "config.json": b"{}",
            "model.safetensors": b"w" * 100,
            "__MACOSX/._config.json": b"junk",
            ".DS_Store": b"junk",
            "notes.txt": b"not a checkpoint file",
        }
    )
    out = extract_run_zip(src, tmp_path / "d", max_total_bytes=LIMIT, accept=lambda n: n != "notes.txt")
    assert sorted(out.files) == ["config.json", "model.safetensors"]
    assert sorted(out.skipped) == [".DS_Store", "__MACOSX/._config.json", "notes.txt"]
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == b"w" * 100
    assert out.total_bytes == 102
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]


def test_one_top_folder_is_dropped(tmp_path):
    src = _zip({"myrun/": b"", "myrun/config.json": b"{}", "myrun/model.safetensors": b"w"})
    out = extract_run_zip(src, tmp_path, max_total_bytes=LIMIT)
    assert sorted(out.files) == ["config.json", "model.safetensors"]
    assert (tmp_path / "config.json").is_file() and not (tmp_path / "myrun").exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../evil.json", r"outside the folder \('\.\.'\)"),
        ("run/../../evil.json", r"outside the folder"),
        ("/etc/evil.json", "absolute path"),
        ("C:/evil.json", "absolute path"),
        ("..\\evil.json", "backslashes"),
    ],
)
def test_zip_slip_names_are_refused_and_nothing_is_written(tmp_path, name, message):
    src = _zip({"config.json": b"{}", name: b"pwned"})
    dest = tmp_path / "a" / "b"
    with pytest.raises(ZipRefused, match=message):
        extract_run_zip(src, dest, max_total_bytes=LIMIT)
    assert not list(tmp_path.rglob("evil.json"))
    assert not dest.exists() or not list(dest.iterdir())


def test_symlink_entry_is_refused(tmp_path):
    info = zipfile.ZipInfo("model.safetensors")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    with pytest.raises(ZipRefused, match="symbolic link"):
        extract_run_zip(_info_zip(info, b"/etc/passwd"), tmp_path, max_total_bytes=LIMIT)
    assert not (tmp_path / "model.safetensors").exists()


def test_special_file_entry_is_refused(tmp_path):
    info = zipfile.ZipInfo("config.json")
    info.external_attr = (stat.S_IFIFO | 0o644) << 16
    with pytest.raises(ZipRefused, match="not a regular file"):
        extract_run_zip(_info_zip(info, b""), tmp_path, max_total_bytes=LIMIT)


def test_zip_bomb_ratio_is_refused_before_writing(tmp_path):
    src = _zip({"config.json": b"{}", "model.safetensors": bytes(4 * 1024**2)}, zipfile.ZIP_DEFLATED)
    with pytest.raises(ZipRefused, match="zip bomb"):
        extract_run_zip(src, tmp_path, max_total_bytes=LIMIT)
    assert not list(tmp_path.iterdir())


def test_total_size_over_the_limit_is_refused(tmp_path):
    src = _zip({"config.json": b"{}", "model.safetensors": b"w" * 5000})
    with pytest.raises(ZipRefused, match=r"would unpack to 4\.9 KiB, over the limit of 4\.0 KiB"):
        extract_run_zip(src, tmp_path, max_total_bytes=4096)


def test_nested_archive_is_refused(tmp_path):
    inner = _zip({"config.json": b"{}"}).getvalue()
    with pytest.raises(ZipRefused, match="nested archives"):
        extract_run_zip(_zip({"inner.zip": inner}), tmp_path, max_total_bytes=LIMIT)


def test_sub_folders_and_two_top_folders_are_refused(tmp_path):
    with pytest.raises(ZipRefused, match=r"sub-folders: \['sub/model.safetensors'\]"):
        extract_run_zip(_zip({"config.json": b"{}", "sub/model.safetensors": b"w"}), tmp_path, max_total_bytes=LIMIT)
    with pytest.raises(ZipRefused, match="sub-folders"):
        extract_run_zip(_zip({"a/config.json": b"{}", "b/config.json": b"{}"}), tmp_path, max_total_bytes=LIMIT)


def test_duplicate_names_are_refused(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("config.json", b"{}")
        with pytest.warns(UserWarning, match="Duplicate name"):
            zf.writestr("config.json", b'{"evil": 1}')
    buf.seek(0)
    with pytest.raises(ZipRefused, match="same file name twice"):
        extract_run_zip(buf, tmp_path, max_total_bytes=LIMIT)


def test_encrypted_entry_is_refused(tmp_path):
    raw = bytearray(_zip({"config.json": b"{}"}).getvalue())
    cd = bytes(raw).rfind(b"PK\x01\x02")
    raw[cd + 8] |= 0x1  # general purpose flag bit 0: encrypted (zipfile's writer never sets it)
    raw[6] |= 0x1  # the same bit in the local header
    with pytest.raises(ZipRefused, match="encrypted"):
        extract_run_zip(io.BytesIO(bytes(raw)), tmp_path, max_total_bytes=LIMIT)


def test_too_many_entries_and_empty_and_not_a_zip(tmp_path):
    with pytest.raises(ZipRefused, match="4 entries; a run folder has at most 3"):
        extract_run_zip(_zip({f"f{i}.json": b"" for i in range(4)}), tmp_path, max_total_bytes=LIMIT, max_entries=3)
    with pytest.raises(ZipRefused, match="holds no files"):
        extract_run_zip(_zip({"d/": b""}), tmp_path, max_total_bytes=LIMIT)
    with pytest.raises(ZipRefused, match="not a readable zip"):
        extract_run_zip(io.BytesIO(b"PK\x03\x04 definitely not"), tmp_path, max_total_bytes=LIMIT)
    with pytest.raises(ZipRefused, match="no checkpoint files"):
        extract_run_zip(_zip({"a.txt": b"x"}), tmp_path, max_total_bytes=LIMIT, accept=lambda n: False)


def test_damaged_data_is_refused_and_partial_files_removed(tmp_path):
    payload = b"0123456789abcdef" * 64
    raw = bytearray(_zip({"config.json": b"{}", "model.safetensors": payload}).getvalue())
    at = bytes(raw).find(payload)
    raw[at + 100] ^= 0xFF  # corrupt the stored bytes: the CRC check fails while unpacking
    dest = tmp_path / "d"
    with pytest.raises(ZipRefused, match="damaged"):
        extract_run_zip(io.BytesIO(bytes(raw)), dest, max_total_bytes=LIMIT)
    assert not list(dest.iterdir())  # config.json, written first, was removed too


def test_entry_larger_than_its_header_declares_is_stopped(tmp_path):
    payload = b"x" * 4000
    raw = bytearray(_zip({"model.safetensors": payload}).getvalue())
    # Lower the declared uncompressed size in the central directory (offset 24 of the entry) to 1000.
    cd = bytes(raw).rfind(b"PK\x01\x02")
    raw[cd + 24 : cd + 28] = (1000).to_bytes(4, "little")
    with pytest.raises(ZipRefused):
        extract_run_zip(io.BytesIO(bytes(raw)), tmp_path, max_total_bytes=LIMIT)
    assert not (tmp_path / "model.safetensors").exists()
