"""TensorBoard event files written by the calling thread, for :class:`toolkit.MetricsWriter` and the
dsat / toolkit.run curves: the records ``SummaryWriter`` writes, without its writer thread
(docs/training.md, What a report costs). Rank 0 only by use; no collective."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import google_crc32c
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary

__all__ = ["STALE_RUN_FILE_S", "EventFile", "record", "write_run"]

_file_ids = itertools.count()  # two writers of one process in one second get two files


def _masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord: length, its masked CRC-32C, data, the data's. Pure."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc32c(header)) + data + struct.pack("<I", _masked_crc32c(data))


class EventFile:
    """A new ``events.out.tfevents.*`` file in ``log_dir`` (created if missing), appended to synchronously.

    ``purge_step``: when resuming, the first step written again; TensorBoard then hides earlier files'
    points from it on (a ``SessionLog.START``, as ``SummaryWriter(purge_step=...)``). ``name``: the
    file's name (holding ``tfevents``), by default a new one of this process. Chief only by use."""

    def __init__(self, log_dir: str | os.PathLike[str], *, purge_step: int | None = None,
                 name: str | None = None) -> None:
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        name = name or (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
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

    def add_summary(self, summary: Summary, *, step: int, wall_time: float) -> None:
        """One event holding ``summary`` (any plugin's, e.g. the HParams session of a run)."""
        self._file.write(record(Event(wall_time=wall_time, step=step, summary=summary).SerializeToString()))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()


#: An earlier file of :func:`write_run` is removed once it is this old: by then a TensorBoard
#: reading it (every 5 s by default) has gone on to the newer one; it would stop at a file removed
#: under it.
STALE_RUN_FILE_S = 600.0


def write_run(log_dir: str | os.PathLike[str], series: Mapping[str, Iterable[tuple[int, float]]], *,
              name: str, purge: bool = True, summaries: Sequence[Summary] = ()) -> Path:
    """A new event file ``name`` in ``log_dir`` (its path returned) holding ``series`` (tag -> points)
    and ``summaries``: a run rewritten whole per new point, so points out of step order still draw as
    curves. Any process. ``purge``: start with a ``SessionLog.START`` at step 0 so TensorBoard drops
    earlier files' points (removed after :data:`STALE_RUN_FILE_S`); only for a directory this writer
    alone fills."""
    directory = Path(log_dir)
    old = sorted(directory.glob(f"events.out.tfevents.*.{name}")) if directory.is_dir() else []
    # microseconds: after every file of an earlier second, and of this one (TensorBoard reads a
    # directory's files in name order and does not go back)
    events = EventFile(directory, purge_step=0 if purge else None,
                       name=f"events.out.tfevents.{time.time_ns() // 1000:016d}.{name}")
    now = time.time()
    try:
        for summary in summaries:
            events.add_summary(summary, step=0, wall_time=now)
        for tag, points in series.items():
            for step, value in sorted(points, key=lambda p: p[0]):
                events.add_scalars(int(step), {tag: float(value)}, wall_time=now)
    finally:
        events.close()
    for path in old if purge else ():  # without a purge, what they hold still counts
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > STALE_RUN_FILE_S:
                path.unlink()
    return events.path
