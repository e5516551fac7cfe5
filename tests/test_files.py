"""toolkit._files: flushing a tree and a directory where the filesystem does not cooperate."""

import os

import pytest

from toolkit._files import atomic_write, fsync_dir, fsync_tree


def test_fsync_dir_is_a_no_op_where_a_directory_cannot_be_opened_or_flushed(tmp_path):
    fsync_dir(tmp_path / "missing")  # cannot be opened
    fsync_dir("/proc")  # procfs refuses fsync on a directory (EINVAL): the rename is still atomic
    fsync_dir(tmp_path)


def test_fsync_tree_skips_a_file_gone_meanwhile(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "kept.bin").write_bytes(b"x")
    # a dangling link is what a temporary file renamed between the walk and the open looks like
    (tmp_path / "sub" / ".renamed.tmp").symlink_to(tmp_path / "sub" / "gone")
    fsync_tree(tmp_path)
    assert (tmp_path / "sub" / "kept.bin").read_bytes() == b"x"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_write(path, "old")

    def fail(fh):
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]
