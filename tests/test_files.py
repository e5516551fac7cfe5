"""toolkit._files: flushing a tree and a directory where the filesystem does not cooperate."""

import os
import threading
import time

import pytest

from toolkit._files import atomic_write, flushing_while_written, fsync_dir, fsync_tree


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


def test_flushing_while_written_flushes_a_growing_file_before_the_block_ends(tmp_path, monkeypatch):
    """A spy on os.fsync (the real one still runs) records which files the thread flushes."""
    flushed: list[tuple[str, int]] = []  # (path, size) at each flush
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        flushed.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    target = tmp_path / "step_5" / "mp_rank_00_model_states.pt"
    with flushing_while_written(tmp_path / "step_5", interval_s=0.005):
        target.parent.mkdir()
        with open(target, "wb") as fh:
            fh.write(b"x" * 4096)
            fh.flush()
            deadline = time.monotonic() + 30
            while (str(target), 4096) not in flushed and time.monotonic() < deadline:
                time.sleep(0.005)
            assert (str(target), 4096) in flushed  # while the writer still holds it open
            time.sleep(0.05)
            assert flushed.count((str(target), 4096)) == 1  # a file that did not grow is not flushed again
            fh.write(b"y" * 4096)
        (tmp_path / "step_5" / "gone").write_bytes(b"z")
        (tmp_path / "step_5" / "gone").unlink()  # a file removed meanwhile is no error
    assert not any(t.name == "toolkit-flush" for t in threading.enumerate())
    assert target.read_bytes() == b"x" * 4096 + b"y" * 4096


def test_flushing_while_written_stops_its_thread_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError, match="disk full"):
        with flushing_while_written(tmp_path / "never_created"):
            raise RuntimeError("disk full")
    assert not any(t.name == "toolkit-flush" for t in threading.enumerate())
