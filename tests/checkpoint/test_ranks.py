"""toolkit/checkpoint/ranks.py's failure message for a write (the collectives: test_api.py, 2 ranks)."""

from toolkit.checkpoint.ranks import write_failure


def test_a_write_failure_names_the_free_space_or_says_it_cannot_tell(tmp_path):
    err = OSError(28, "No space left on device")
    text = write_failure("saving 'step_1'", err, tmp_path / "step_1")  # not made yet: its parent is measured
    assert text.startswith("saving 'step_1': OSError: [Errno 28] No space left on device (")
    assert f"under {tmp_path / 'step_1'}" in text and "previous checkpoint is still the latest" in text
    gone = write_failure("saving 'step_1'", err, tmp_path / "no" / "such" / "dir")
    assert "(is the disk full or over quota?)" in gone
