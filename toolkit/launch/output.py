"""A job's output by trial and rank: files per rank, one labelled log per trial, the console. Shared by
dsat's trial runner and ``python -m toolkit.run``; launcher process only. The files and why not pipes:
docs/design-dsat-runner.md#output-by-trial-and-rank. Example::

    pump = OutputPump(trial_dir, label="trial 3", echo=True, fresh=True)
    argv = build_trial_argv(entrypoint, launcher="torchrun", nproc=2, master_port=port,
                            rank_logs=pump.ranks_dir)
    with pump.launcher_file() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pump.start(); ...; pump.stop()
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import IO, BinaryIO

__all__ = ["LAUNCHER_LOG", "RANKS_DIR", "TRIAL_LOG", "OutputPump", "rank_log_options", "rank_of",
           "ranks_lines", "split_lines"]

#: Under the trial's directory: the files the launcher writes per rank.
RANKS_DIR = "ranks"
#: Every line of the trial (its ranks and its launcher), labelled, in the order they were read.
TRIAL_LOG = "trial.log"
#: The launcher's own stdout and stderr (and, for a launch across hosts, the ranks' too).
LAUNCHER_LOG = "launcher.log"
#: How often the files are read.
POLL_S = 0.1
#: A longer line is cut into pieces of this many bytes (a progress bar without newlines).
MAX_LINE = 8192
_READ_CHUNK = 1 << 20  # per file and pass: a flood is read over several passes, memory stays bounded

_TORCHRUN_FILE = re.compile(r"attempt_\d+/(\d+)/(stdout|stderr)\.log$")
_DEEPSPEED_FILE = re.compile(r"_rank(\d+)\.log$")
_console_lock = threading.Lock()


def rank_log_options(launcher: str, directory: Path) -> list[str]:
    """The options that make ``launcher`` write each rank's output to files under ``directory``:
    torchrun's ``--log-dir D --redirects 3``, DeepSpeed's ``--enable_each_rank_log=D``."""
    if launcher == "torchrun":
        return ["--log-dir", str(directory), "--redirects", "3"]
    if launcher == "deepspeed":
        return [f"--enable_each_rank_log={directory}"]
    raise ValueError(f"launcher={launcher!r}: expected 'torchrun' or 'deepspeed'")


def rank_of(relative: str) -> tuple[int | None, str]:
    """``(rank, "out" or "err")`` of a file under ``ranks/`` (``none_x/attempt_0/1/stderr.log``,
    ``20260101120000_rank3.log``); ``(None, "")``: no rank's output (torchrun's ``error.json``)."""
    relative = relative.replace(os.sep, "/")
    match = _TORCHRUN_FILE.search(relative)
    if match:
        return int(match.group(1)), "out" if match.group(2) == "stdout" else "err"
    match = _DEEPSPEED_FILE.search(relative)
    if match and "/" not in relative:
        return int(match.group(1)), "out"
    return None, ""


def split_lines(data: bytes, *, final: bool = False) -> tuple[list[bytes], bytes]:
    """The complete lines of ``data`` (ended by a newline or a lone carriage return, as a progress
    bar redraws; empty ones dropped, long ones cut at :data:`MAX_LINE` bytes) and the rest, which
    ends no line yet (``final``: the rest is a line too)."""
    hold = b""
    if not final and data.endswith(b"\r"):  # perhaps the first half of a \r\n: wait for the next byte
        data, hold = data[:-1], b"\r"
    parts = re.split(rb"\r\n|\r|\n", data)
    rest = (b"" if final else parts.pop()) + hold
    lines = [p[i:i + MAX_LINE] for p in parts if p for i in range(0, len(p), MAX_LINE)]
    while len(rest) > MAX_LINE:
        lines.append(rest[:MAX_LINE])
        rest = rest[MAX_LINE:]
    return lines, rest


def ranks_lines(text: str) -> str:
    """The ranks' lines of a ``trial.log`` text, or all of it when no rank wrote one: what a failed
    trial said, not its launcher's epilogue around it."""
    lines = text.splitlines()
    ranks = [line for line in lines if not line.startswith("[launcher] ")]
    return "\n".join(ranks if ranks else lines)


class _Source:
    """One file being followed: where it was read to, and its unfinished last line."""

    def __init__(self, path: Path, *, rank: int | None, stream: str, offset: int) -> None:
        self.path, self.rank, self.stream, self.offset, self.rest = path, rank, stream, offset, b""

    def read(self, *, final: bool) -> list[bytes]:
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # truncated: a new launch wrote it afresh
                    self.offset, self.rest = 0, b""
                fh.seek(self.offset)
                data = fh.read(_READ_CHUNK)
        except OSError:
            return []
        self.offset += len(data)
        more = self.offset < size
        lines, self.rest = split_lines(self.rest + data, final=final and not more)
        return lines + (self.read(final=final) if more and final else [])


class OutputPump:
    """Follows a trial's launcher and rank files into ``trial.log`` and, with ``echo``, the console (the
    launcher's lines too with ``echo_launcher``), naming the trial ``label`` (None: ranks only).
    ``fresh``: an earlier run's files in ``directory`` go, else they are kept and not shown again;
    ``tail``: the recent lines kept for :meth:`last_lines`. Launcher process only; one per trial (or
    per run of ``toolkit.run``), in its own thread."""

    def __init__(self, directory: Path, *, label: str | None, echo: bool, fresh: bool,
                 echo_launcher: bool = True, tail: int = 20) -> None:
        self.directory = Path(directory)
        self.ranks_dir = self.directory / RANKS_DIR
        self.log_path = self.directory / TRIAL_LOG
        self.label, self.echo, self.echo_launcher = label, echo, echo_launcher
        if fresh:
            shutil.rmtree(self.ranks_dir, ignore_errors=True)
            for name in (TRIAL_LOG, LAUNCHER_LOG):
                (self.directory / name).unlink(missing_ok=True)
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        self._sources: dict[str, _Source] = {}
        self._scan(skip_existing=True)
        self._recent = {False: collections.deque[str](maxlen=tail), True: collections.deque[str](maxlen=tail)}
        self._log: BinaryIO = open(self.log_path, "ab")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def launcher_file(self) -> IO[bytes]:
        """``launcher.log`` opened for appending: the launcher's stdout and stderr (the caller closes it)."""
        return open(self.directory / LAUNCHER_LOG, "ab")

    def start(self) -> None:
        """Follow the files in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name=f"output {self.label or self.directory.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Read the files to their end (the launcher has exited), flush and close. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        elif not self._log.closed:
            self._pass(final=True)
        if not self._log.closed:
            self._log.close()

    def last_lines(self) -> list[str]:
        """The ranks' most recent lines, labelled as in ``trial.log`` (the launcher's when no rank
        wrote one)."""
        return list(self._recent[False] or self._recent[True])

    def failure_text(self, what: str) -> str:
        """``what`` (e.g. "trial 3 failed: exit status 1"), its last lines and where its log is."""
        lines = self.last_lines()
        shown = "".join(f"\n  {line}" for line in lines) if lines else "\n  (it printed nothing)"
        return f"{what}; its last lines (whole log: {self.log_path}):{shown}"

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._pass(final=False)
        self._pass(final=True)

    def _scan(self, *, skip_existing: bool = False) -> None:
        """Find new files: the launcher's log and the rank files (at their end when ``skip_existing``)."""
        found: list[tuple[Path, int | None, str]] = [(self.directory / LAUNCHER_LOG, None, "launcher")]
        for root, _dirs, files in os.walk(self.ranks_dir):
            for name in files:
                path = Path(root) / name
                rank, stream = rank_of(str(path.relative_to(self.ranks_dir)))
                if rank is not None:
                    found.append((path, rank, stream))
        for path, rank, stream in found:
            key = str(path)
            if key not in self._sources and (path.exists() or not skip_existing):
                offset = path.stat().st_size if skip_existing and path.exists() else 0
                self._sources[key] = _Source(path, rank=rank, stream=stream, offset=offset)

    def _pass(self, *, final: bool) -> None:
        self._scan()
        # the ranks first: a rank's last words come before its launcher's epilogue about them
        for source in sorted(self._sources.values(), key=lambda s: s.rank is None):
            lines = source.read(final=final)
            if lines:
                self._emit(source, lines)
        self._log.flush()

    def _emit(self, source: _Source, lines: list[bytes]) -> None:
        tag = "launcher" if source.rank is None else f"rank {source.rank}"
        if source.rank is None:
            prefix = f"[{self.label or 'launcher'}] "
        else:
            prefix = f"[{self.label} {tag}] " if self.label else f"[{tag}] "
        text = [line.decode("utf-8", errors="replace") for line in lines]
        self._log.write("".join(f"[{tag}] {t}\n" for t in text).encode("utf-8"))
        self._recent[source.rank is None].extend(f"[{tag}] {t}" for t in text)
        if self.echo and (source.rank is not None or self.echo_launcher):
            stream = sys.stdout if source.stream == "out" else sys.stderr
            with _console_lock:
                try:
                    stream.write("".join(f"{prefix}{t}\n" for t in text))
                    stream.flush()
                except (OSError, ValueError):  # a closed console (a pipe whose reader left) stops no trial
                    self.echo = False
