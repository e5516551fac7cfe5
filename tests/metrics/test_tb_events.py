"""EventFile's framing against TensorBoard's own writer and reader (no processes)."""

import io
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer.record_writer import RecordWriter

from toolkit.metrics.tb_events import STALE_RUN_FILE_S, EventFile, record


@given(st.binary(max_size=4096))
def test_a_record_is_byte_for_byte_tensorboards(data):
    expected = io.BytesIO()
    RecordWriter(expected).write(data)
    assert record(data) == expected.getvalue()


def test_tensorboard_reads_the_scalars_back(tmp_path):
    events = EventFile(tmp_path, purge_step=3)
    for step in range(3, 8):
        events.add_scalars(step, {"training/loss": 1.0 / step, "training/samples_per_second": 100.0 + step},
                           wall_time=1_700_000_000.0 + step)
    events.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("training/loss")]
    assert [s for s, _ in loss] == list(range(3, 8))
    assert loss[-1][1] == pytest.approx(1.0 / 7, rel=1e-6)  # simple_value is a float32
    assert [e.step for e in acc.Scalars("training/samples_per_second")] == list(range(3, 8))


def test_a_corrupt_checksum_is_noticed_by_tensorboards_reader(tmp_path):
    # The checksums are not decoration: TensorBoard's reader refuses a record whose CRC is wrong,
    # so a wrong implementation would lose the points this file's other tests read back.
    events = EventFile(tmp_path)
    events.add_scalars(1, {"training/loss": 0.5}, wall_time=1_700_000_000.0)
    events.close()
    raw = bytearray(events.path.read_bytes())
    raw[-1] ^= 0xFF
    events.path.write_bytes(bytes(raw))
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert "training/loss" not in acc.Tags()["scalars"]


def test_a_run_rewritten_whole_reads_in_step_order_also_by_a_reader_that_read_it_before(tmp_path):
    from toolkit.metrics.tb_events import write_run

    run = tmp_path / "curves" / "stage_1"
    write_run(run, {"metrics/throughput": [(8, 80.0), (2, 30.0)]}, name="dsat-curve")
    live = EventAccumulator(str(run), size_guidance={"scalars": 0})   # a TensorBoard already open
    live.Reload()
    assert [(e.step, e.value) for e in live.Scalars("metrics/throughput")] == [(2, 30.0), (8, 80.0)]
    # a point arrives between the others: a new file, which purges the points before it
    write_run(run, {"metrics/throughput": [(8, 80.0), (2, 30.0), (4, 50.0)]}, name="dsat-curve")
    assert len(list(run.iterdir())) == 2   # the first goes once it is old: a reader on it would stop there
    live.Reload()
    fresh = EventAccumulator(str(run), size_guidance={"scalars": 0})
    fresh.Reload()
    for reader in (live, fresh):   # the live one drops what it read (the purge at step 0), no duplicates
        points = [(e.step, e.value) for e in reader.Scalars("metrics/throughput")]
        assert points == [(2, 30.0), (4, 50.0), (8, 80.0)]
    # without the purge (a directory the trial's chief also writes to), the others' files stay
    other = EventFile(tmp_path / "trial")
    other.add_scalars(3, {"validation/x": 1.0}, wall_time=1_700_000_000.0)
    other.close()
    write_run(tmp_path / "trial", {}, name="toolkit-hparams", purge=False)
    reader = EventAccumulator(str(tmp_path / "trial"))
    reader.Reload()
    assert [e.step for e in reader.Scalars("validation/x")] == [3]
    assert len(list((tmp_path / "trial").iterdir())) == 2
    # a file of an earlier rewrite is removed once old, the others kept
    first = sorted(run.iterdir())[0]
    os.utime(first, (time.time() - STALE_RUN_FILE_S - 1,) * 2)
    write_run(run, {"metrics/throughput": [(2, 30.0)]}, name="dsat-curve")
    assert len(list(run.iterdir())) == 2 and not first.exists()
