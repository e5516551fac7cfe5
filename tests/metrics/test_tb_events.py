"""EventFile's framing against TensorBoard's own writer and reader (no processes)."""

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer.record_writer import RecordWriter

from toolkit.metrics.tb_events import EventFile, record


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
