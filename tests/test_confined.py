"""Paths from untrusted data stay inside their directory; only regular files are read."""

import os

import pytest

from ttftc.confined import UnsafePathError, confined_path, read_regular, regular_file


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", "a\\b", "", "a/.", "-/x"])
def test_names_that_are_not_plain_relative_paths_are_refused(tmp_path, name):
    with pytest.raises(UnsafePathError):
        confined_path(tmp_path, name)


def test_plain_names_stay_inside(tmp_path):
    assert confined_path(tmp_path, "graphs/b16.json") == tmp_path.resolve() / "graphs" / "b16.json"
    assert confined_path(tmp_path, "weights.safetensors").parent == tmp_path.resolve()


def test_a_directory_symlinked_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "graphs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="leads outside"):
        confined_path(root, "graphs/x.json")
    (root / "inner").mkdir()
    (root / "alias").symlink_to(root / "inner", target_is_directory=True)  # a symlink that stays inside is fine
    assert confined_path(root, "alias/x.json") == (root / "inner").resolve() / "x.json"


def test_only_regular_files_are_read(tmp_path):
    (tmp_path / "plain").write_bytes(b"data")
    assert read_regular(tmp_path / "plain", limit=4) == b"data"
    assert regular_file(tmp_path / "plain") == tmp_path / "plain"
    (tmp_path / "link").symlink_to(tmp_path / "plain")
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(UnsafePathError):
            read_regular(tmp_path / name, limit=1 << 20)
        with pytest.raises(UnsafePathError):
            regular_file(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", limit=1 << 20)


def test_a_directory_is_refused_like_any_non_regular_file(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(UnsafePathError, match="not a regular file"):
        read_regular(tmp_path / "dir", limit=1 << 20)


def test_a_file_over_its_limit_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "five").write_bytes(b"12345")
    assert read_regular(tmp_path / "five", limit=5) == b"12345"
    with pytest.raises(UnsafePathError, match="larger than 4 bytes"):
        read_regular(tmp_path / "five", limit=4)
    with pytest.raises(TypeError, match="byte limit"):
        read_regular(tmp_path / "five", limit=None)
