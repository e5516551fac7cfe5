"""``python3 -m determined.launch.wrap_rank RANK [--] CMD...``: run a worker, its output prefixed by its rank.

Determined's own, reached through the shim toolkit.run puts on ``PYTHONPATH``
(:func:`toolkit.launch.wrappers.shim_pythonpath`). Any process (the wrapper is not a rank). What it does as
Determined's, and ``TOOLKIT_DET_WRAPPED_RANK``: docs/design-determined.md#wrap_rank-and-the-shim. Example::

    python3 -m determined.launch.wrap_rank 0 -- python3 4_distributed.py worker 0 0
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from typing import IO, Any, Iterator, Mapping

from toolkit.errors import ConfigError, LaunchEnvError
from toolkit.launch.wrappers import WRAPPED_ENV

__all__ = ["main", "parse_rank", "split_lines"]

_LINE_END = re.compile(rb"[\r\n]")
_CHUNK = 8191
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGWINCH")


def parse_rank(spec: str, environ: Mapping[str, str]) -> int | None:
    """``"3"`` -> 3; ``"RANK,OMPI_COMM_WORLD_RANK"`` -> the first of those variables set; else None. Pure.
    Raises ConfigError for a negative number, LaunchEnvError for a variable that is no integer >= 0."""
    if re.fullmatch(r"\s*[+-]?\d+\s*", spec):
        if int(spec) < 0:
            raise ConfigError(f"RANK={spec!r}: expected an integer >= 0, or comma-separated names of "
                              "environment variables holding it (e.g. RANK,OMPI_COMM_WORLD_RANK)")
        return int(spec)
    for name in spec.split(","):
        if name in environ:
            value = environ[name]
            if not re.fullmatch(r"\s*\+?\d+\s*", value):
                raise LaunchEnvError(f"{name}={value!r} (named by wrap_rank's RANK argument {spec!r}) is not "
                                     "an integer >= 0; set it to this worker's rank")
            return int(value)
    return None


def split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines of a byte stream, ended by ``\\n`` or ``\\r`` (each yielded with ``\\n``), cut at 8 KiB as
    Determined's log shipper does (an endless progress bar cannot hold the output back). Pure.

    Example:
        >>> list(split_lines(iter([b"a\\rb", b"c\\nd"])))
        [b'a\\n', b'bc\\n', b'd\\n']
    """
    pending = b""
    for chunk in chunks:
        pending += chunk
        while True:
            match = _LINE_END.search(pending)
            if match is None:
                break
            yield pending[: match.start()] + b"\n"
            pending = pending[match.end():]
        while len(pending) >= _CHUNK:
            yield pending[:_CHUNK] + b"\n"
            pending = pending[_CHUNK:]
    if pending:
        yield pending + b"\n"


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a pipe may take part of a line)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _forward(source: IO[bytes], fd: int, prefix: bytes) -> None:
    chunks = iter(lambda: os.read(source.fileno(), _CHUNK), b"")
    for line in split_lines(chunks):
        _write_all(fd, prefix + line)


class _Passthru:
    """Signal handlers passing the signals on to the command; those received before it exists are kept."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pending: list[int] = []
        for name in _FORWARDED:
            signal.signal(getattr(signal, name), self)

    def __call__(self, signum: int, frame: Any) -> None:
        if self.proc is None:
            self.pending.append(signum)
        else:
            self.proc.send_signal(signum)

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        for signum in self.pending:
            proc.send_signal(signum)


def main(argv: list[str] | None = None) -> int:
    """The command line; the command's exit status (1: RANK names no set variable; 2: bad RANK). Any
    process: the wrapper of one worker."""
    parser = argparse.ArgumentParser(
        prog="python3 -m determined.launch.wrap_rank",
        usage="wrap_rank [-h] [--no-redirect-stdio] RANK SCRIPT...",
        description="Run SCRIPT with every output line prefixed by [rank=RANK] (toolkit's wrap_rank).",
    )
    parser.add_argument("--no-redirect-stdio", action="store_true")
    parser.add_argument("rank", metavar="RANK", help="an integer, or names of variables holding it")
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT...")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("empty script is not allowed")
    try:
        rank = parse_rank(args.rank, os.environ)
    except (ConfigError, LaunchEnvError) as err:
        parser.error(str(err))
    if rank is None:
        sys.stderr.write(f"rank environment variable is set to {args.rank}, but it is not in os.environ\n")
        return 1
    passthru = _Passthru()  # before the command starts: no signal is lost in between
    proc = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                            env={**os.environ, WRAPPED_ENV: str(rank)})
    passthru.attach(proc)
    prefix = f"[rank={rank}] ".encode()
    threads = [threading.Thread(target=_forward, args=(stream, fd, prefix), daemon=True)
               for stream, fd in ((proc.stdout, sys.stdout.fileno()), (proc.stderr, sys.stderr.fileno()))]
    for thread in threads:
        thread.start()
    status = proc.wait()  # as long as the command runs, by design: its launcher bounds the run
    for thread in threads:  # a process the command left behind may hold its pipes open
        thread.join(timeout=5)
    return status
