"""The disk fills up during a save: the error says so on every rank, nothing hangs, the previous
checkpoint stays the latest and loads, and the directory takes checkpoints again afterwards.

One 2-rank launch of tests/reliability/workers/ckpt_disk_full.py (ZeRO-1) tries three ways:

* ``tmpfs``: the checkpoint directory is a 2 MiB tmpfs, filled up to a few KiB; the kernel
  answers ENOSPC (needs the right to mount: skipped, with the reason, where it is missing);
* ``rlimit``: every rank's RLIMIT_FSIZE is 1 KiB, so each data file write fails with EFBIG as
  a full disk or a quota would fail it;
* ``rlimit1``: only rank 1 is limited: one rank fails while the other writes normally.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import procutil

CATEGORY = "disk full during save"
WORKER = procutil.REPO / "tests" / "reliability" / "workers" / "ckpt_disk_full.py"
MODES = ("tmpfs", "rlimit", "rlimit1")


def _mount_tmpfs(path) -> str | None:
    """None when mounted, else why not."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"mount failed: {err}"
    return None if done.returncode == 0 else f"mount -t tmpfs not permitted here: {done.stderr.strip()}"


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory):
    base = tmp_path_factory.mktemp("disk_full")
    ckpt, out = base / "ckpt", base / "out"
    ckpt.mkdir()
    out.mkdir()
    no_tmpfs = _mount_tmpfs(ckpt)
    modes = [m for m in MODES if m != "tmpfs" or no_tmpfs is None]
    try:
        argv = procutil.torchrun_argv(WORKER, str(ckpt), str(out), ",".join(modes))
        result = procutil.run(argv, timeout=300)
    finally:
        if no_tmpfs is None:
            subprocess.run(["umount", str(ckpt)], capture_output=True, timeout=60)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
             for r in range(2)]
    return result, ranks, no_tmpfs


@pytest.mark.parametrize("mode", MODES)
def test_a_full_disk_fails_the_save_cleanly(disk_full, mode):
    result, ranks, no_tmpfs = disk_full
    if mode == "tmpfs" and no_tmpfs:
        pytest.skip(no_tmpfs)
    assert result.returncode == 0 and None not in ranks, result.stdout[-5000:]
    for rank, report in enumerate(ranks):
        record = report["modes"][mode]
        error = record["error"] or ""
        assert record["error_type"] in ("CheckpointError", "OSError"), (rank, record)
        # The message says what failed: the write, with the kernel's reason, on every rank.
        # torch reports ENOSPC inside DeepSpeed's save as a bare RuntimeError; toolkit adds the free space.
        reason = {"tmpfs": "the disk is full", "rlimit": "File too large", "rlimit1": "File too large"}[mode]
        assert reason in error and "Nothing was committed" in error, (rank, error)
        assert "DeepSpeed could not write" in error or "writing the RNG states" in error, (rank, error)
        if mode == "rlimit1" and rank == 0:
            assert "rank 1" in error, error  # the healthy rank names the rank that failed
        assert record["latest"] == "step_1" and record["chosen"] == "step_1", (rank, record)
    for report in ranks:
        assert report["loaded_steps"] == 1 and report["loaded_state"] == {"at": 1}
        assert report["saved_after"] == "step_2"
