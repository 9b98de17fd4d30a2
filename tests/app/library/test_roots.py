"""app.library.roots: paths the app may open are confined to the configured roots, symlinks resolved first."""

from __future__ import annotations

import os

import pytest

from app.library.roots import PathRefused, confine, confine_folder
from app.server.settings import ROOTS_ENV, configured_roots


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "run" / "config.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text("{}")
    return root, outside


def test_path_inside_a_root_is_returned_resolved(tree):
    root, _ = tree
    assert confine(root / "run", [root]) == (root / "run").resolve()
    assert confine(str(root / "run" / ".." / "run"), [root]) == (root / "run").resolve()
    assert confine(root, [root]) == root.resolve()  # the root itself


def test_outside_path_is_refused_with_how_to_allow_it(tree):
    root, outside = tree
    with pytest.raises(PathRefused, match=r"outside the folders this app may open .*--root DIR"):
        confine(outside, [root])


def test_dotdot_escape_is_refused(tree):
    root, outside = tree
    with pytest.raises(PathRefused, match="outside"):
        confine(f"{root}/run/../../outside", [root])


def test_sibling_with_a_common_prefix_is_not_inside(tmp_path):
    root = tmp_path / "data"
    sibling = tmp_path / "data-private"
    root.mkdir()
    sibling.mkdir()
    with pytest.raises(PathRefused, match="outside"):
        confine(sibling, [root])


def test_symlink_out_of_a_root_is_refused(tree):
    root, outside = tree
    (root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathRefused, match="outside"):
        confine(root / "link", [root])
    with pytest.raises(PathRefused, match="outside"):
        confine(root / "link" / "secret.json", [root])


def test_symlink_inside_a_root_is_allowed(tree):
    root, _ = tree
    (root / "alias").symlink_to(root / "run", target_is_directory=True)
    assert confine(root / "alias", [root]) == (root / "run").resolve()


def test_a_file_linking_out_of_an_allowed_folder_is_refused(tree):
    root, outside = tree
    (root / "run" / "model.safetensors").symlink_to(outside / "secret.json")
    with pytest.raises(PathRefused, match=r"model\.safetensors is a link to a file outside"):
        confine_folder(root / "run", [root])
    assert confine(root / "run", [root])  # the folder alone is inside


def test_confine_folder_wants_a_folder(tree):
    root, _ = tree
    with pytest.raises(PathRefused, match="not a folder"):
        confine_folder(root / "run" / "config.json", [root])
    assert confine_folder(root / "run", [root]) == (root / "run").resolve()


def test_missing_paths_inside_say_so_outside_paths_do_not_leak_existence(tree):
    root, outside = tree
    with pytest.raises(PathRefused, match="no such file or folder"):
        confine(root / "nope", [root])
    with pytest.raises(PathRefused, match="outside"):
        confine(outside / "nope", [root])


def test_relative_paths_resolve_against_the_base(tree):
    root, _ = tree
    assert confine("run", [root], base=root) == (root / "run").resolve()
    with pytest.raises(PathRefused, match="outside"):
        confine("../outside", [root], base=root)


def test_empty_and_nul_paths_are_refused(tree):
    root, _ = tree
    with pytest.raises(PathRefused, match="No folder given"):
        confine("  ", [root])
    with pytest.raises(PathRefused, match="NUL"):
        confine(f"{root}/run\x00", [root])


def test_symlink_loop_is_refused(tree):
    root, _ = tree
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    with pytest.raises(PathRefused):
        confine(root / "a", [root])


def test_configured_roots_default_and_env(tmp_path):
    home, cwd, extra1, extra2 = (tmp_path / n for n in ("home", "cwd", "x1", "x2"))
    assert configured_roots(home, env={}, cwd=cwd) == [home.resolve(), cwd.resolve()]
    env = {ROOTS_ENV: os.pathsep.join([str(extra1), str(extra2), str(extra1)])}
    assert configured_roots(home, env=env, cwd=cwd) == [home.resolve(), extra1.resolve(), extra2.resolve()]
