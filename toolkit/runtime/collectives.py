"""Bounded collectives: a toolkit collective that one rank calls alone fails fast, with a name.

A "call on all ranks" collective called on some ranks only (``if ctx.is_chief: writer.report(...)``)
would wait out the process group's 30-minute timeout in silence. Toolkit's own collectives run on
a gloo group of their own with a short timeout (default 60 s), after which every waiting rank raises
:class:`CollectiveTimeoutError` naming the call and the ranks that never reached it. How the missing
ranks are found, and the setting: docs/training.md (A collective called on one rank fails)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

import torch.distributed as dist

from toolkit._checks import is_number
from toolkit.errors import ConfigError

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "DEFAULT_COLLECTIVE_TIMEOUT_S", "RECORD_AFTER_S", "BoundedGroup",
           "CollectiveTimeoutError", "new_bounded_group", "resolve_collective_timeout"]

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_ENV = "TOOLKIT_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
#: A rank waiting longer than this in a toolkit collective records its arrival in the store.
RECORD_AFTER_S = 0.5

T = TypeVar("T")


class CollectiveTimeoutError(RuntimeError):
    """A toolkit collective did not complete on this rank: some rank did not call it. ``call`` names it
    (``"ctx.all_gather_object"``); ``missing``: the ranks that had not reached it (empty: unknown)."""

    def __init__(self, message: str, *, call: str, missing: list[int]) -> None:
        super().__init__(message)
        self.call = call
        self.missing = missing


def resolve_collective_timeout(value: Any = None, environ: Mapping[str, str] | None = None) -> float:
    """The collective timeout in seconds: ``value`` (seconds or a timedelta), else
    ``TOOLKIT_COLLECTIVE_TIMEOUT_S`` in ``environ``, else 60; ConfigError unless positive and finite. Pure."""
    env = os.environ if environ is None else environ
    source = "collective_timeout"
    if value is None:
        raw = env.get(COLLECTIVE_TIMEOUT_ENV)
        if raw is None or raw.strip() == "":
            return DEFAULT_COLLECTIVE_TIMEOUT_S
        source = COLLECTIVE_TIMEOUT_ENV
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{COLLECTIVE_TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0, "
                              "for example 120") from None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}={value!r}: expected a number of seconds > 0 (or a "
                          "datetime.timedelta), for example 120")
    return float(value)


class BoundedGroup:
    """A gloo group whose collectives fail after ``timeout_s`` with a named error. Call on all ranks.

    Made by :func:`toolkit.init_distributed` (``ctx.collectives``); toolkit's modules run their
    collectives through :meth:`run` (blocking) or :meth:`arrive` + :meth:`wait` (async)."""

    def __init__(self, *, rank: int, world_size: int, timeout_s: float, group: Any = None,
                 store: Any = None, prefix: str = "toolkit/arrived") -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.group = group
        self._store = store
        self._prefix = prefix
        self._count = 0
        self._call = ""
        self.record_after_s = min(RECORD_AFTER_S, timeout_s / 8)

    def arrive(self, call: str) -> int:
        """Count this rank's next toolkit collective ``call``; returns its number. No I/O. Any rank."""
        self._count += 1
        self._call = call
        return self._count

    def run(self, call: str, fn: Callable[[Any], T]) -> T:
        """``fn(group)``, a blocking collective on :attr:`group`, with the bound (CollectiveTimeoutError
        naming ``call`` and the missing ranks). Call on all ranks."""
        number = self.arrive(call)
        token = _RECORDER.watch(self)
        try:
            return fn(self.group)
        except RuntimeError as err:
            raise self.failure(call, number, err) from err
        finally:
            _RECORDER.unwatch(token)

    def wait(self, call: str, number: int, work: Any) -> None:
        """Wait for the async collective launched after ``arrive(call)`` gave ``number``. All ranks."""
        try:
            if work.is_completed():  # launched long enough ago (the pipelined check): no bookkeeping
                work.wait()
                return
            token = _RECORDER.watch(self)
            try:
                work.wait()
            finally:
                _RECORDER.unwatch(token)
        except RuntimeError as err:
            raise self.failure(call, number, err) from err

    def record(self) -> None:
        """Write this rank's count of toolkit collectives to the store. Any rank, any thread."""
        if self._store is None:
            return
        try:
            self._store.set(f"{self._prefix}/{self.rank}", f"{self._count} {self._call}")
        except RuntimeError as err:  # the store is a diagnosis aid, never a reason to fail
            logger.debug("could not record arrival at %s: %s", self._call, err)

    def failure(self, call: str, number: int, err: BaseException) -> CollectiveTimeoutError:
        """The error for collective ``number`` that failed with ``err``. Any rank; it first records this
        rank's count and waits ``record_after_s`` so that a late rank has recorded its own."""
        if self._store is not None:
            self.record()
            time.sleep(self.record_after_s + 0.2)
        arrived = self._arrivals()
        missing = [r for r, (n, _) in arrived.items() if r != self.rank and n < number]
        elsewhere = [f"rank {r} is at #{n} ({c})" for r, (n, c) in arrived.items()
                     if r != self.rank and n > number]
        if missing:
            who = f"rank(s) {missing} never reached it"
        elif arrived:
            who = "every rank reached it, so a rank failed or left inside it"
        else:
            who = "the ranks that did not reach it cannot be told"
        extra = f" ({'; '.join(elsewhere)})" if elsewhere else ""
        return CollectiveTimeoutError(
            f"{call} (toolkit collective #{number}) did not complete within {self.timeout_s:g} s "
            f"on rank {self.rank}: {who}{extra}. It must be called on all ranks, the same number of "
            f"times, in the same order (not under 'if ctx.is_chief:'); if ranks can legitimately "
            f"arrive more than "
            f"{self.timeout_s:g} s apart, raise init_distributed(collective_timeout=...) or "
            f"{COLLECTIVE_TIMEOUT_ENV}. Cause: {err}", call=call, missing=missing)

    def _arrivals(self) -> dict[int, tuple[int, str]]:
        """Every rank's last recorded arrival, from the store; ranks with none count as #0."""
        if self._store is None:
            return {}
        out: dict[int, tuple[int, str]] = {}
        try:
            for r in range(self.world_size):
                key = f"{self._prefix}/{r}"
                if not self._store.check([key]):
                    out[r] = (0, "no toolkit collective yet")
                    continue
                count, _, call = self._store.get(key).decode().partition(" ")
                out[r] = (int(count), call)
        except (RuntimeError, ValueError) as err:
            logger.debug("could not read the ranks' arrivals: %s", err)
            return {}
        return out


class _Recorder:
    """One daemon thread per process that records in the store the arrival of a rank whose wait in a
    toolkit collective has lasted ``record_after_s``. It sleeps until the earliest deadline, so it
    costs nothing while no collective is slow. Any rank."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._due: dict[int, tuple[float, BoundedGroup]] = {}
        self._next_token = 0
        self._thread: threading.Thread | None = None
        self._pid = 0

    def watch(self, group: BoundedGroup) -> int:
        """Record ``group``'s arrival unless :meth:`unwatch` comes first; returns the token (0: none).
        Any rank, from the thread about to wait."""
        if group._store is None:
            return 0
        with self._cond:
            if self._thread is None or self._pid != os.getpid():  # first use, or a forked child
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="toolkit-collective-recorder",
                                                daemon=True)
                self._thread.start()
            self._next_token += 1
            at = time.monotonic() + group.record_after_s
            if not self._due or at < min(due for due, _ in self._due.values()):
                self._cond.notify()  # the thread sleeps without a deadline, or past this one
            self._due[self._next_token] = (at, group)
            return self._next_token

    def unwatch(self, token: int) -> None:
        """The wait of ``token`` (from :meth:`watch`) is over: nothing to record. Any rank."""
        if token:
            with self._cond:
                self._due.pop(token, None)

    def _loop(self) -> None:
        with self._cond:
            while True:
                if not self._due:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                ready = [token for token, (at, _) in self._due.items() if at <= now]
                if not ready:
                    self._cond.wait(min(at for at, _ in self._due.values()) - now)
                    continue
                groups = [self._due.pop(token)[1] for token in ready]
                self._cond.release()
                try:
                    for group in groups:
                        group.record()
                finally:
                    self._cond.acquire()


_RECORDER = _Recorder()


def new_bounded_group(*, rank: int, world_size: int, timeout_s: float, prefix: str) -> BoundedGroup:
    """A fresh gloo group with ``timeout_s``. Call on all ranks, in the same order; ``prefix`` names the
    group's arrival keys in the store and must differ between groups."""
    if world_size == 1:
        return BoundedGroup(rank=rank, world_size=1, timeout_s=timeout_s)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    store = _default_store()
    return BoundedGroup(rank=rank, world_size=world_size, timeout_s=timeout_s, group=group, store=store,
                        prefix=prefix)


def _default_store() -> Any:
    """The launcher's key-value store of the default process group, or None if torch hides it."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None
