"""TensorBoard event files written by the calling thread, for :class:`toolkit.MetricsWriter`.

``torch.utils.tensorboard.SummaryWriter``'s writer thread contends with the training loop for the
GIL; here the same events are written in one burst per batch of reports, by the thread that
reports them, with ``google_crc32c`` checksums, one new file per writer. Rank 0 only by use (no
collective). Why: docs/training.md (What a report costs).

Example::

    # rank 0 only, as MetricsWriter's chief does
    if ctx.is_chief:
        events = EventFile("runs/exp1")
        events.add_scalars(10, {"training/loss": 0.25}, wall_time=time.time())
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Mapping

import google_crc32c
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary

__all__ = ["EventFile", "record"]

_file_ids = itertools.count()  # two writers of one process in one second get two files


def _masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord: length, its masked CRC-32C, data, the data's. Pure."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc32c(header)) + data + struct.pack("<I", _masked_crc32c(data))


class EventFile:
    """A new ``events.out.tfevents.*`` file in ``log_dir``, appended to synchronously.

    Args:
        log_dir: created if missing.
        purge_step: when resuming, the first step written again: TensorBoard then hides the
            points at and after it from earlier files (a ``SessionLog.START`` at that step,
            as ``SummaryWriter(purge_step=...)`` writes).

    Example (chief only)::

        if ctx.is_chief:
            events = EventFile("runs/exp1")
            events.add_scalars(10, {"training/loss": 0.25}, wall_time=time.time())
            events.close()
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, purge_step: int | None = None) -> None:
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_file_ids)}")
        self.path = directory / name
        self._file = open(self.path, "wb")
        now = time.time()
        self._file.write(record(Event(wall_time=now, file_version="brain.Event:2").SerializeToString()))
        if purge_step is not None:
            self._file.write(record(Event(wall_time=now, step=purge_step,
                                          session_log=SessionLog(status=SessionLog.START)).SerializeToString()))

    def add_scalars(self, step: int, values: Mapping[str, float], *, wall_time: float) -> None:
        """One event at ``step`` holding a scalar per tag (buffered until :meth:`flush`)."""
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._file.write(record(Event(wall_time=wall_time, step=step, summary=summary).SerializeToString()))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
