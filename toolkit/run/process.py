"""Start one run of the plan, pass signals to its ranks, leave no process behind. Runner process only.

Called by :mod:`toolkit.run.trial` once per run. Every process of a run is marked by
``DET_ALLOCATION_ID``; where a signal goes and why: docs/design-determined.md#one-run-processes-and-signals.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from toolkit.errors import ConfigError
from toolkit.launch.argv import build_trial_argv
from toolkit.launch.experiment_env import CONFIG_WARNED_ENV, environment_variables
from toolkit.launch.output import OutputPump
from toolkit.launch.procs import (
    cpu_slots,
    find_trial_processes,
    free_port,
    is_rank_process,
    kill_until_gone,
    scan_processes,
)
from toolkit.launch.wrappers import CONTAINER_PER_RANK_ENV, WRAPPED_ENV, shim_pythonpath
from toolkit.run.plan import RunPlan
from toolkit.runtime.trial_env import BUILD_GUARDS_ENV, EXPERIMENT_CONFIG_ENV, OUTPUT_DIR_ENV

__all__ = ["MARK_ENV", "SHIELD_USR1_ENV", "STOP_SIGNALS", "Forwarder", "check_slots", "deepspeed_include",
           "environment", "run_once", "signal_targets"]

logger = logging.getLogger("toolkit.run")

#: Marks every process of one run (Determined's name for one run of a trial), to find them all.
MARK_ENV = "DET_ALLOCATION_ID"
#: Set (to "1") in a run's environment: its launcher starts with SIGUSR1 ignored (inherited by the
#: ranks until ``watch_preemption`` installs its handler). Slurm's ``scancel --signal=USR1 JOB``
#: reaches every process of a step, torchrun too, which SIGUSR1 would kill (``--slurm`` trials).
SHIELD_USR1_ENV = "TOOLKIT_RUN_SHIELD_USR1"
#: What toolkit.watch_preemption watches: passed to the ranks.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def signal_targets(table: Mapping[int, tuple[int, bytes]], pids: set[int]) -> list[int]:
    """The processes of ``pids`` a forwarded signal goes to (``table``: pid -> (ppid, environ)). Pure; any
    process. The ranks and what they started, less the ``wrap_rank`` process and the script that launched a
    wrapped worker (``TOOLKIT_DET_WRAPPED_RANK``): it waits for its workers and exits with them."""
    ranks = {pid for pid in pids if pid in table and is_rank_process(table[pid][1])}
    marker = b"\0" + WRAPPED_ENV.encode() + b"="
    wrapped = {pid for pid in ranks if marker in b"\0" + table[pid][1]}
    spared: set[int] = set()
    for pid in wrapped:
        parent = table[pid][0]
        while parent in ranks and parent not in wrapped and parent not in spared:
            spared.add(parent)
            parent = table[parent][0]
    return sorted(ranks - spared)


class Forwarder:
    """Passes SIGTERM/SIGINT/SIGUSR1 to the run's ranks (before they exist: the launcher's process group);
    :meth:`searcher_stop` sends the same stop. Runner only. A signal before the start is remembered
    (:func:`run_once` then starts nothing). ``install=False``: no handlers; a search's main thread calls
    :meth:`handle`."""

    def __init__(self, *, install: bool = True) -> None:
        self.proc: subprocess.Popen | None = None
        self.mark = ""
        self.received: int | None = None
        #: The searcher (ASHA) asked to stop the current run through the preemption signal.
        self.searcher_stopped = False
        #: ... and the signal was sent to a live run (False: the run had already ended).
        self.searcher_sent = False
        self._previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS} if install else {}

    def handle(self, signum: int, frame: Any = None) -> None:
        """A stop signal for this run: remembered, and passed to its ranks (a signal handler)."""
        if self.received is None:
            logger.warning(
                "received %s: passing it to the ranks, which save and stop", signal.Signals(signum).name
            )
        self.received = self.received or signum
        self._send(signum)

    def attach(self, proc: subprocess.Popen, mark: str) -> None:
        """The run's launcher process from now on; a signal received before it existed is sent now."""
        self.proc, self.mark = proc, mark
        if self.received is not None:
            self._send(self.received)
        elif self.searcher_stopped and not self.searcher_sent:  # the searcher's stop came between two runs
            self.searcher_sent = self._send(signal.SIGTERM)

    def searcher_stop(self) -> None:
        """Stop the current run as a preemption does (SIGTERM to its ranks), for the searcher."""
        self.searcher_stopped = True
        self.searcher_sent = self._send(signal.SIGTERM)

    @property
    def stopping(self) -> bool:
        return self.received is not None or self.searcher_stopped

    def _send(self, signum: int) -> bool:
        """Pass ``signum`` on; False when there is no live run to send it to."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        # To the ranks themselves: the launcher then sees them exit 0 after saving, and exits 0.
        table = scan_processes()
        ranks = signal_targets(
            table, find_trial_processes(self.mark, root=self.proc.pid, variable=MARK_ENV, table=table)
        )
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if not ranks:  # not started yet: the launcher stops what it started
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                return False
        return True

    def restore(self) -> None:
        """Put back the signal handlers this forwarder replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def check_slots(plan: RunPlan, *, gpus: int | None = None) -> None:
    """Refuse a process count this machine cannot run: more than its GPUs (``gpus`` None: torch's count),
    or on CPU its cores. Runner only. Raises ConfigError naming ``resources.slots_per_trial`` (or the
    wrapper's ``--nproc_per_node``), the value and the most this machine runs."""
    if gpus is None:
        import torch  # already loaded by the CLI

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    most, what = (gpus, f"{gpus} GPU(s)") if gpus else (cpu_slots(), f"{cpu_slots()} CPU core(s)")
    if plan.nproc <= most:
        return
    slots = (plan.config.get("resources") or {}).get("slots_per_trial", 1)
    key = "resources.slots_per_trial" if slots == plan.nproc else "the entrypoint's --nproc_per_node"
    raise ConfigError(f"{key}={plan.nproc}: one process per slot, and this machine has {what}; expected at "
                      f"most {most}", source=str(plan.config_path))


_ports_lock = threading.Lock()
_ports_in_use: set[int] = set()  # the rendezvous ports of the runs in flight (a search runs several)


def _take_port() -> int:
    with _ports_lock:
        for _ in range(100):
            port = free_port()
            if port not in _ports_in_use:
                _ports_in_use.add(port)
                return port
    raise RuntimeError("could not find a free TCP port on 127.0.0.1")


def deepspeed_include(plan: RunPlan, env: Mapping[str, str]) -> str | None:
    """DeepSpeed's ``--include`` for the run's GPUs (the first ``nproc`` of ``CUDA_VISIBLE_DEVICES``), or
    None (torchrun, no such variable, or UUIDs). Pure; any process.
    Why: docs/design-determined.md#one-run-processes-and-signals."""
    ids = [x.strip() for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    ids = ids[: plan.nproc]
    if plan.launcher != "deepspeed" or len(set(ids)) < plan.nproc or not all(x.isdigit() for x in ids):
        return None
    return "localhost:" + ",".join(ids)


def _launch_argv(plan: RunPlan, port: int, env: Mapping[str, str],
                 rank_logs: Path | None = None) -> list[str]:
    argv = build_trial_argv(plan.command, launcher=plan.launcher, nproc=plan.nproc, master_port=port,
                            include=deepspeed_include(plan, env), rank_logs=rank_logs)
    if plan.launcher == "torchrun" and "--max_restarts" not in argv:
        argv.insert(3, "--max_restarts=0")  # restarts are this runner's (with a resume)
    return argv


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def run_once(plan: RunPlan, env: dict[str, str], *, forwarder: Forwarder, grace_s: float,
             output: OutputPump | None = None) -> int:
    """Start the run, wait for it, kill what is left; its exit status. Runner only (a search's thread).
    A signal already in ``forwarder``: nothing starts, 0. ``output``: where the ranks and launcher
    write (:mod:`toolkit.launch.output`); None: this process's streams."""
    if forwarder.received is not None:
        logger.info("%s received before the run started: not starting it",
                    signal.Signals(forwarder.received).name)
        return 0
    mark = f"toolkit-run-{uuid.uuid4().hex[:12]}"
    port = _take_port()
    argv = _launch_argv(plan, port, env, None if output is None else output.ranks_dir)
    logger.info("starting %s", shlex.join(argv))
    try:
        shield = _ignore_usr1 if env.get(SHIELD_USR1_ENV) == "1" else None  # only in a Slurm job's runner
        with output.launcher_file() if output is not None else contextlib.nullcontext() as out:
            proc = subprocess.Popen(argv, cwd=plan.model_dir, env={**env, MARK_ENV: mark},
                                    start_new_session=True, preexec_fn=shield, stdout=out,
                                    stderr=None if out is None else subprocess.STDOUT)
    except BaseException:
        with _ports_lock:
            _ports_in_use.discard(port)
        raise
    forwarder.attach(proc, mark)
    deadline: float | None = None
    try:
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            if forwarder.stopping and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                logger.error("the ranks did not stop within %.0f s of the signal; killing them", grace_s)
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        forwarder.proc = None
        kill_until_gone(
            lambda table: find_trial_processes(mark, root=proc.pid, variable=MARK_ENV, table=table),
            grace_s=5.0,
            reap=[proc],
            what="run",
        )
        with _ports_lock:
            _ports_in_use.discard(port)


def environment(plan: RunPlan, base: Mapping[str, str] | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The entrypoint's environment: this one's, the YAML's ``environment_variables``, the toolkit's
    variables and ``extra`` (a search's per-trial GPUs, threads, handshake). Runner only. Each variable
    and why: docs/design-determined.md#one-run-processes-and-signals."""
    import torch  # already loaded by the CLI

    env = dict(os.environ if base is None else base)
    env.update(environment_variables(plan.config, device="cuda" if torch.cuda.is_available() else "cpu"))
    env[CONFIG_WARNED_ENV] = "1"
    env[BUILD_GUARDS_ENV] = "1"
    env[EXPERIMENT_CONFIG_ENV] = str(plan.config_path)
    env[OUTPUT_DIR_ENV] = str(plan.output_dir)
    env.update(extra or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not plan.wrapped:
        env[CONTAINER_PER_RANK_ENV] = "1"
    pythonpath = shim_pythonpath(env)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    here = os.path.dirname(sys.executable)
    found = shutil.which("python3", path=env.get("PATH"))
    beside = os.path.join(here, "python3")
    if os.path.exists(beside) and (found is None or os.path.realpath(found) != os.path.realpath(beside)):
        env["PATH"] = os.pathsep.join([here, env.get("PATH", "")])
    if plan.launcher == "deepspeed":
        if not torch.cuda.is_available():
            env["LOCAL_SIZE"] = str(plan.nproc)  # DeepSpeed counts CPU "devices" from it
    return env
