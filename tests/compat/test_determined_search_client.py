"""A search's trial's side of toolkit.run's search (toolkit.compat.determined.search_client): the chief
waits after a report until the runner has read it, and goes on with a warning when it does not answer."""

import logging
import threading
import time

from toolkit.compat.determined.search_client import wait_for_searcher
from toolkit.launch.trial_files import ACK_FILE, SEARCH_ACK_ENV


def test_the_chief_waits_until_the_runner_read_its_report(tmp_path, monkeypatch, caplog):
    wait_for_searcher(tmp_path, 10**9, timeout_s=60)  # outside a search: at once
    monkeypatch.setenv(SEARCH_ACK_ENV, str(tmp_path / "another-trial"))
    wait_for_searcher(tmp_path, 10**9, timeout_s=60)  # another trial's handshake: at once
    monkeypatch.setenv(SEARCH_ACK_ENV, str(tmp_path))
    ack = tmp_path / ACK_FILE
    timer = threading.Timer(0.3, lambda: ack.write_text("120"))
    start = time.monotonic()
    timer.start()
    wait_for_searcher(tmp_path, 120, timeout_s=60)
    assert 0.25 < time.monotonic() - start < 5
    wait_for_searcher(tmp_path, 100, timeout_s=60)  # read already
    with caplog.at_level(logging.WARNING):
        wait_for_searcher(tmp_path, 121, timeout_s=0.2)  # a runner that does not answer
    assert "did not read the validation report within" in caplog.text
