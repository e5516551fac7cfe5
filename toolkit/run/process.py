"""Start one run of the plan, pass signals to its ranks, leave no process behind. Runner process only.

Every process of a run carries ``DET_ALLOCATION_ID=<unique>`` in its environment, so that all
of them are found (``/proc``) and killed at the end, also those a rank started in a session of
its own. A forwarded signal goes to the rank processes themselves (torchrun then sees them
exit 0 after saving, and exits 0), except a self-launching script's own process: when a rank
started workers through ``determined.launch.wrap_rank`` (Determined's ``4_distributed.py``), the
workers get the signal and the launcher waits for them, as on Determined, where the master
never signals the launcher (:func:`signal_targets`).

Each rank of an entrypoint without a launcher wrapper is one Determined container of one slot
(``TOOLKIT_DET_CONTAINER_PER_RANK``): Determined runs such an entrypoint once per container, so
a script that starts ``len(info.slot_ids)`` workers per container starts one per rank here, and
its workers' ranks (``container_rank * len(slot_ids) + local``) are the torchrun ranks.
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
import time
import uuid
from typing import Any, Callable, Mapping

from toolkit.compat.determined.info import CONTAINER_PER_RANK_ENV
from toolkit.compat.determined.wrap_rank import WRAPPED_ENV, shim_pythonpath
from toolkit.errors import ConfigError
from toolkit.launch.argv import build_trial_argv
from toolkit.launch.experiment_env import CONFIG_WARNED_ENV, environment_variables
from toolkit.launch.procs import (
    cpu_slots,
    find_trial_processes,
    free_port,
    is_rank_process,
    kill_until_gone,
    scan_processes,
)
from toolkit.run.plan import RunPlan
from toolkit.runtime.trial_env import EXPERIMENT_CONFIG_ENV, OUTPUT_DIR_ENV

__all__ = ["MARK_ENV", "Forwarder", "check_slots", "environment", "run_once", "signal_targets"]

logger = logging.getLogger("toolkit.run")

#: Marks every process of one run (Determined's name for one run of a trial), to find them all.
MARK_ENV = "DET_ALLOCATION_ID"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # what toolkit.watch_preemption watches


def signal_targets(table: Mapping[int, tuple[int, bytes]], pids: set[int]) -> list[int]:
    """The processes of ``pids`` a forwarded signal goes to (``table``: pid -> (ppid, environ)).

    Pure; any process. The rank processes (and what they started), except the processes between
    a wrapped worker (``TOOLKIT_DET_WRAPPED_RANK`` set) and its launcher: the ``wrap_rank`` process and the
    script that launched it, which waits for its workers to stop and then exits with them.
    """
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
    """Signal handlers that pass SIGTERM/SIGINT/SIGUSR1 to the run's rank processes (or, before they exist,
    to the launcher's process group); :meth:`searcher_stop` sends the same stop for the searcher.

    Runner only (it installs this process's signal handlers; :meth:`restore` puts them back). A
    signal that arrives before a run has started is remembered: :func:`run_once` then starts
    nothing, or passes it on as soon as the run's process exists (:meth:`attach`).
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.mark = ""
        self.received: int | None = None
        #: The searcher (ASHA) asked to stop the current run through the preemption signal.
        self.searcher_stopped = False
        #: ... and the signal was sent to a live run (False: the run had already ended).
        self.searcher_sent = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in _FORWARDED}

    def _handle(self, signum: int, frame: Any) -> None:
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

    def searcher_stop(self) -> None:
        """Stop the current run as a preemption does (SIGTERM to its ranks), for the searcher."""
        self.searcher_stopped = True
        self.searcher_sent = self._send(signal.SIGTERM)

    def new_trial(self) -> None:
        """Forget the searcher's stop of the previous trial (a search's next trial)."""
        self.searcher_stopped = self.searcher_sent = False

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
    """Refuse a process count this machine cannot run: more than its GPUs, or on CPU its cores. Runner only.

    ``gpus``: the GPUs of this machine (None: ``torch.cuda.device_count()`` when CUDA is available).

    Raises:
        ConfigError: naming ``resources.slots_per_trial`` (or the wrapper's ``--nproc_per_node``),
            the value given and the most this machine runs.
    """
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


def _launch_argv(plan: RunPlan) -> list[str]:
    argv = build_trial_argv(plan.command, launcher=plan.launcher, nproc=plan.nproc, master_port=free_port())
    if plan.launcher == "torchrun" and "--max_restarts" not in argv:
        argv.insert(3, "--max_restarts=0")  # restarts are this runner's (with a resume)
    return argv


def run_once(plan: RunPlan, env: dict[str, str], *, forwarder: Forwarder, grace_s: float,
             watch: Callable[[], bool] | None = None) -> int:
    """Start the run, wait for it, kill what is left; its exit status. Runner only.

    ``watch()`` True: the searcher stops the run (preemption signal). When ``forwarder`` has
    already received a signal, nothing is started and 0 is returned (a stop before the start).
    """
    if forwarder.received is not None:
        logger.info("%s received before the run started: not starting it",
                    signal.Signals(forwarder.received).name)
        return 0
    mark = f"toolkit-run-{uuid.uuid4().hex[:12]}"
    argv = _launch_argv(plan)
    logger.info("starting %s", shlex.join(argv))
    proc = subprocess.Popen(argv, cwd=plan.model_dir, env={**env, MARK_ENV: mark}, start_new_session=True)
    forwarder.attach(proc, mark)
    deadline: float | None = None
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if watch is not None and not forwarder.stopping and watch():
                forwarder.searcher_stop()
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


def environment(plan: RunPlan, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The entrypoint's environment (runner only): this one's, plus the experiment, the output directory, and

    * the YAML's ``environment.environment_variables`` (the ``cpu`` or ``cuda`` list by this
      machine's device), for every rank and what it starts;
    * ``TOOLKIT_DET_CONFIG_WARNED=1``: the runner warned about the YAML's ignored keys, the ranks stay quiet;
    * ``TOOLKIT_DET_CONTAINER_PER_RANK=1`` for an entrypoint without a launcher wrapper (each
      rank one Determined container of one slot; see the module docstring);
    * the ``determined.launch.wrap_rank`` shim on ``PYTHONPATH`` when no real ``determined``
      package is importable;
    * this interpreter's directory first on ``PATH`` when ``python3`` there is another Python
      (an unactivated virtual environment): Determined's scripts start ``python3`` by name.
    """
    import torch  # already loaded by the CLI

    env = dict(os.environ if base is None else base)
    env.update(environment_variables(plan.config, device="cuda" if torch.cuda.is_available() else "cpu"))
    env[CONFIG_WARNED_ENV] = "1"
    env[EXPERIMENT_CONFIG_ENV] = str(plan.config_path)
    env[OUTPUT_DIR_ENV] = str(plan.output_dir)
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
