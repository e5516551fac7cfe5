"""Stop every rank at the same step when a scheduler asks the job to stop. Call on all ranks.

A signal (SIGTERM, Slurm's ``--signal=USR1@120``) may reach one rank first: :func:`watch_preemption`
records it, ``should_preempt()`` agrees on it, and every rank saves and exits 0 at the same step.
The agreement, its cost and delay bound: docs/training.md (Preemption); docs/start.md (Stop a job).

Example (``torchrun --nproc_per_node 2 train.py``; SIGTERM to any one rank stops both)::

    with toolkit.watch_preemption(ctx) as preemption:
        for step, batch in enumerate(loader, start=1):
            train_step(batch)
            if preemption.should_preempt():
                toolkit.save_checkpoint(engine, ckpt_dir, steps_completed=step)
                break
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any, Iterable

import torch
import torch.distributed as dist

from toolkit._checks import is_int, is_number
from toolkit.errors import ConfigError
from toolkit.runtime.collectives import BoundedGroup, new_bounded_group
from toolkit.runtime.context import DistributedContext
from toolkit.runtime.launcher_watch import LauncherMonitor, ProcessInfo, remember_launchers
from toolkit.runtime.worker_signals import protect_dataloader_workers, stop_signals

__all__ = ["PreemptionWatcher", "watch_preemption", "DEFAULT_SIGNALS", "MAX_ADAPTIVE_CHECK_EVERY",
           "AgreedStop", "last_agreed_stop"]

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: Upper bound on the adaptive interval, in calls; it keeps the delay bound finite in calls.
MAX_ADAPTIVE_CHECK_EVERY = 1000
_CALL = "PreemptionWatcher.should_preempt"


def _check_arguments(signals: Iterable[Any], check_every: Any,
                     check_interval: Any) -> tuple[signal.Signals, ...]:
    """Every problem of watch_preemption's arguments, raised once as a ConfigError."""
    problems: list[str] = []
    chosen = stop_signals(signals, problems)
    if check_every is not None and (not is_int(check_every) or check_every < 1):
        problems.append(f"check_every={check_every!r}: expected a whole number >= 1 (calls between "
                        "two check points), or None to adapt the interval to the step time")
    if not is_number(check_interval) or not math.isfinite(check_interval) or check_interval <= 0:
        problems.append(f"check_interval={check_interval!r}: expected a number of seconds > 0, "
                        "for example 1.0")
    if problems:
        raise ConfigError(problems)
    return chosen


#: Stop signals whose default action would end a rank that is already stopping for a preemption.
_ECHOES = frozenset({signal.SIGTERM, signal.SIGUSR1})


def _ignore_repeated_stop(signum: int, frame: Any) -> None:
    """After a preemption was agreed: a repeated SIGTERM/SIGUSR1 changes nothing (any rank).
    A Python handler, not SIG_IGN, so that processes the rank starts afterwards get the default."""


_groups_made = 0  # watchers that made a group in this process: names each group's arrival keys


def seconds_since_stop() -> float | None:
    """Seconds since a watcher of this process first agreed on a stop, or None. Any rank (a save after
    the stop logs its upload against the scheduler's grace: toolkit.checkpoint.remote)."""
    return None if _first_stop is None else time.monotonic() - _first_stop.monotonic


@dataclasses.dataclass(frozen=True)
class AgreedStop:
    """A stop every rank agreed on in this process: why, and when (``time.time()``)."""

    cause: str
    at: float
    monotonic: float = 0.0   # time.monotonic() then, for durations


_last_stop: AgreedStop | None = None
_first_stop: AgreedStop | None = None


def last_agreed_stop() -> AgreedStop | None:
    """The last stop agreed in this process by any watcher, or None. Any rank (the same on all)."""
    return _last_stop


class PreemptionWatcher:
    """Turns a signal seen by any rank into the same ``should_preempt()`` answer on every rank.

    Made by :func:`watch_preemption` (its arguments). Leaving it, or :meth:`close`, restores the earlier
    handlers, but after an agreed stop a default SIGTERM/SIGUSR1 stays ignored (a repeated stop must
    not kill the rank between its save and its exit). Like any collective: every rank calls
    :meth:`should_preempt` equally often and closes the watcher at the same point."""

    def __init__(self, ctx: DistributedContext, *, signals: Iterable[Any] = DEFAULT_SIGNALS,
                 check_every: int | None = None, check_interval: float = 1.0) -> None:
        if not isinstance(ctx, DistributedContext):
            raise TypeError(f"ctx={ctx!r}: expected the DistributedContext returned by "
                            "toolkit.init_distributed()")
        self._signals = _check_arguments(signals, check_every, check_interval)
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("watch_preemption() was called outside the main thread; Python delivers "
                               "signals to the main thread only, so create the watcher there")
        if ctx.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"ctx says world size {ctx.world_size} but torch.distributed is not "
                               "initialised; get ctx from toolkit.init_distributed()")
        self.check_every = check_every
        self.check_interval = float(check_interval)
        self._world_size = ctx.world_size
        self._bounded = self._make_group(ctx)
        protect_dataloader_workers(self._signals)
        self._signum = 0            # written by the handler only; 0 = no signal yet
        self._requested = False     # request_stop()
        self._gone: ProcessInfo | None = None  # a launcher that exited; written by the monitor thread
        self._decided = False
        self._closed = False
        self._calls = 0
        self._interval = check_every or 1
        self._target_ns = int(self.check_interval * 1e9)
        # At world size 1 every call is a (free) check point; otherwise the first one is at call I.
        self._next_check = 0 if ctx.world_size == 1 else self._interval
        self._last_check_call = 0
        # From creation: the first check point then measures the time per call already, so that
        # a loop that calls rarely agrees synchronously from its second call on.
        self._last_check_ns = time.perf_counter_ns()
        self._sync = False          # agree at the call (rare calls); decided from reduced values
        self._measured = False      # True after the first reduced time per call
        self._pending: Any = None   # (arrival number, the all-reduce in flight: a torch Work)
        # One buffer is enough: the previous all-reduce is always consumed before the next launch.
        # Written and read through a numpy view, which costs far less than building a tensor.
        self._buffer = torch.zeros(4, dtype=torch.int64)
        self._values = self._buffer.numpy()
        self._logged_local = False
        # One bound-method object, so that close() can recognise its own handler by identity.
        self._handler = self._on_signal
        self._previous: dict[signal.Signals, Any] = {}
        try:
            for sig in self._signals:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handler)
        except BaseException:
            self._restore_handlers()
            raise
        self._monitor = LauncherMonitor(remember_launchers(), self._on_launcher_exit).start()
        logger.info("watching %s for preemption; %s", ", ".join(s.name for s in self._signals),
                    f"check every {check_every} call(s)" if check_every else
                    f"check about every {self.check_interval:g} s")

    # Runs in the main thread between two bytecodes, possibly in the middle of a collective or of
    # a logging call of the loop: record only. Repeated signals are ignored on purpose: Ctrl-C under
    # torchrun delivers SIGINT twice (terminal, then torchrun forwarding it), and Slurm may repeat
    # SIGTERM; neither must turn the clean stop into an abrupt one.
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._signum:
            self._signum = signum

    # The monitor thread: a launcher of this rank exited (docs/start.md, Stop a job). Record only.
    def _on_launcher_exit(self, process: ProcessInfo) -> None:
        if self._gone is None:
            self._gone = process
            logger.warning("this rank's launcher %s has exited: stopping as if signalled, every rank at "
                           "the same step", process.describe())

    @property
    def launcher_exited(self) -> bool:
        """True once this rank saw one of its launchers exit (then it stops as if signalled). Any rank."""
        return self._gone is not None

    @property
    def received_signal(self) -> signal.Signals | None:
        """The first watched signal *this* rank received (the others stop too), or None. Any rank."""
        return signal.Signals(self._signum) if self._signum else None

    @property
    def preempted(self) -> bool:
        """The last agreed answer of :meth:`should_preempt`, without counting a call. Any rank."""
        return self._decided

    def request_stop(self) -> None:
        """Ask for a stop as if this rank were signalled (a time budget one rank checks). Any rank."""
        self._requested = True

    def should_preempt(self) -> bool:
        """True on every rank at the same call once any rank received a watched signal. Call on all ranks.

        Once per step (with gradient accumulation, per optimizer step, so a stop lands where a checkpoint
        resumes exactly). Once True it stays True; after :meth:`close` it returns the last agreed answer
        and does no collective. Cost and delay bound: docs/training.md (Preemption)."""
        if self._decided or self._closed:
            return self._decided
        self._calls += 1
        if self._calls < self._next_check:
            return False
        if self._signum and not self._logged_local:
            self._log_local()
        if self._world_size == 1:
            if self._signum or self._requested or self._gone:
                self._decide(self._signum, self._requested, self._gone is not None)
            return self._decided
        return self._check_point()

    def _check_point(self) -> bool:
        if self._pending is not None and self._read_agreed():
            return True
        self._launch()
        if self._sync:  # rare calls: the answer at this call, not at the next check point
            if self._read_agreed():
                return True
            if not self._sync:  # just switched to the pipeline: keep one all-reduce in flight
                self._launch()
        self._next_check = self._calls + self._interval
        return False

    def _launch(self) -> None:
        now = time.perf_counter_ns()
        calls = self._calls - self._last_check_call
        ns_per_call = (now - self._last_check_ns) // calls if calls else 0  # 0: nothing measured
        self._values[:] = (self._signum, int(self._requested), ns_per_call, int(self._gone is not None))
        number = self._bounded.arrive(_CALL)
        work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self._bounded.group,
                               async_op=True)
        self._pending = (number, work)
        if calls:
            self._last_check_call, self._last_check_ns = self._calls, now

    def _read_agreed(self) -> bool:
        """Wait for the all-reduce in flight and act on its result; True once a stop is agreed."""
        (number, work), self._pending = self._pending, None
        self._bounded.wait(_CALL, number, work)
        signum, requested, ns_per_call, gone = self._values.tolist()
        if signum or requested or gone:
            self._decide(signum, bool(requested), bool(gone))
            return True
        if ns_per_call > 0:
            # Same inputs on every rank (the reduced values), hence the same next check point.
            # The first measurement runs from the watcher's creation and may catch a call made right
            # away: it may switch to synchronous checks, but not lengthen the interval.
            if self.check_every is None and self._measured:
                self._interval = max(1, min(MAX_ADAPTIVE_CHECK_EVERY, self._target_ns // ns_per_call))
            self._measured = True
            self._sync = ns_per_call * self._interval >= self._target_ns
        return False

    @staticmethod
    def _make_group(ctx: DistributedContext) -> BoundedGroup:
        """The watcher's own bounded gloo group: its agreement never pairs with another collective."""
        global _groups_made
        if ctx.world_size == 1:
            return ctx.collectives
        _groups_made += 1
        return new_bounded_group(rank=ctx.rank, world_size=ctx.world_size,
                                 timeout_s=ctx.collective_timeout, prefix=f"toolkit/preemption{_groups_made}")

    def _log_local(self) -> None:
        self._logged_local = True
        logger.warning("received %s; every rank will stop at the same step within %s",
                       signal.Signals(self._signum).name, "this call" if self._world_size == 1 else
                       f"about {2 * self._interval} calls")

    def _decide(self, signum: int, requested: bool, gone: bool) -> None:
        global _last_stop, _first_stop
        self._decided = True
        if self._signum and not self._logged_local:
            self._log_local()
        cause = (signal.Signals(signum).name if signum else "a launcher exited" if gone
                 else "a stop request (request_stop)")
        _last_stop = AgreedStop(cause=cause, at=time.time(), monotonic=time.monotonic())
        _first_stop = _first_stop or _last_stop
        logger.info("preemption agreed at call %d: %s on at least one rank; stopping", self._calls, cause)

    def close(self) -> None:
        """Restore the earlier signal handlers and wait for the all-reduce in flight, so that no toolkit
        collective outlives the loop. Call on all ranks; idempotent."""
        self._close(wait=True)

    def _close(self, *, wait: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._monitor.stop()
        pending, self._pending = self._pending, None
        try:
            self._restore_handlers()
        finally:
            if pending is not None and wait:
                self._bounded.wait(_CALL, *pending)
        if wait and self._decided:
            from toolkit.checkpoint.stop_record import record_agreed_stop  # light; no cycle at import

            record_agreed_stop()

    def _restore_handlers(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) is not self._handler:
                # Someone replaced our handler after us (a nested watcher closed out of order, a
                # library): theirs stays, and restoring ours-before-them would be wrong.
                logger.debug("the %s handler is no longer the watcher's; leaving it", sig.name)
                continue
            if previous is None:
                # Installed from C, not by Python: it cannot be put back from Python.
                logger.warning("the %s handler in place before the watcher was not installed from "
                               "Python and cannot be restored; using the default action", sig.name)
                previous = signal.SIG_DFL
            if previous == signal.SIG_DFL and sig in _ECHOES and (self._decided or self._signum):
                # Stopping for a preemption: the same stop often arrives again (Slurm signals every
                # process of the step while a launcher passes it on too); after the loop it must not
                # kill the rank between its save and its exit. SIGINT and SIGKILL still end it.
                previous = _ignore_repeated_stop
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "PreemptionWatcher":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # On an exception other ranks may never reach the check point in flight: waiting could
        # hang this rank instead of letting the launcher see the failure and stop the job.
        self._close(wait=exc_type is None)


def watch_preemption(ctx: DistributedContext, *, signals: Iterable[Any] = DEFAULT_SIGNALS,
                     check_every: int | None = None, check_interval: float = 1.0) -> PreemptionWatcher:
    """Install signal handlers and return the watcher that agrees on a stop. Call on all ranks.

    In the main thread, before the loop, with the same arguments on every rank; use the watcher as a
    context manager. While it is open, a launcher of this rank that exits is a stop too.

    Args:
        signals: those that mean "stop soon"; SIGINT is one, so that Ctrl-C stops cleanly too.
        check_every: calls between two check points; None adapts them to ``check_interval`` seconds.

    Raises ConfigError for bad arguments, TypeError for a ``ctx`` not from ``init_distributed``,
    RuntimeError outside the main thread or without torch.distributed."""
    return PreemptionWatcher(ctx, signals=signals, check_every=check_every, check_interval=check_interval)
