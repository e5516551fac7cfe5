"""toolkit.runtime.rendezvous_wait without a listener: when there is nothing to wait for, and a marker
that cannot be written. The wait for a real earlier run's rank 0 is in test_launcher_watch.py."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from toolkit.runtime import rendezvous_wait
from toolkit.runtime.run_conflict import WAIT_ENV


@pytest.mark.parametrize("addr", ["a" * 64 + ".example", "node..01", "host\udcff"])
def test_a_name_that_cannot_be_resolved_is_no_local_address(addr):
    assert not rendezvous_wait.is_local_address(addr)


def test_nothing_is_waited_for_without_a_local_address_and_port(monkeypatch):
    # A bad bound would raise ConfigError were it read: these return before reading it, at once.
    monkeypatch.setenv(WAIT_ENV, "soon")
    started = time.monotonic()
    for addr, port in [(None, 29500), ("127.0.0.1", None), ("192.0.2.1", 29500), ("a" * 64 + ".x", 29500)]:
        assert rendezvous_wait.wait_for_rendezvous_port(addr, port) is None
    assert time.monotonic() - started < 5


def test_a_marker_that_cannot_be_written_is_skipped_and_no_port_marks_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rendezvous_wait.mark_rendezvous(None)
    rendezvous_wait.mark_rendezvous(0)
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / f"toolkit-{os.getuid()}"     # a file where the markers' directory belongs
    blocker.write_text("not a directory")
    assert rendezvous_wait.marker_path(29500).parent == blocker
    rendezvous_wait.mark_rendezvous(29500)            # a later run's wait needs it, this run does not
    assert blocker.read_text() == "not a directory" and list(tmp_path.iterdir()) == [blocker]


def test_a_table_that_cannot_be_read_is_skipped(tmp_path):
    assert rendezvous_wait.listening_inodes(29500, tables=(str(tmp_path / "no-such-table"),)) == set()
