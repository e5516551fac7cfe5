"""Run dsat trials as real processes: launch, watch, classify, and leave nothing behind.

The only module of toolkit that spawns processes. Each trial is the experiment's entrypoint
started by torchrun or DeepSpeed's launcher (:func:`toolkit.dsat.launcher.build_trial_argv`)
on its slots, in ``output_dir/trials/trial_<id>/`` with::

    ds_config.json   the trial's complete DeepSpeed config
    hparams.json     the experiment's hyperparameters, deepspeed_config -> ds_config.json
    trial.json       the TrialContract read by dsat_reporting_context
    stdout.log, stderr.log, result.json (written by the trial)
    output/          the trial's own output directory (TOOLKIT_OUTPUT_DIR, see toolkit.get_output_dir);
                     emptied when the trial id is started again

Every process of a trial carries ``TOOLKIT_DSAT_TRIAL=<abs path of trial.json>`` in its
environment. That mark, not the process group, is how its processes are found: torchrun starts
each worker in a session of its own, so killing torchrun's group misses them, and a torchrun
killed with SIGKILL leaves them orphaned. A trial's processes are those whose
``/proc/<pid>/environ`` carries its mark, plus every descendant of its launcher
(``/proc/<pid>/stat``). They get SIGTERM, then SIGKILL after a grace period, until none is left.

Outcomes, decided from the exit status and the result file, never from the logs:

=========================================  ==============================================
ran past ``timeout_s``                     TIMEOUT (all its processes killed)
a worker's RSS above ``memory_per_slot``   OOM "RSS X MiB exceeded the memory budget ..."
result ``"oom"``                           OOM (CUDA out of memory inside the trial)
result ``"ok"`` with the 5 metrics, exit 0 OK (the profiling trial also needs its profile)
unreadable or malformed result             FAILED "corrupt result file: ..."
result ``"failed"``, exit 0                FAILED with the trial's own reason
exit 0 and no result                       FAILED "exited 0 without a result file"
any other exit                             FAILED "exit status N" / "killed by signal SIGX"
=========================================  ==============================================

FAILED errors end with the last lines of the trial's stderr, for display only. A trial's
workers (the processes with ``LOCAL_RANK`` set, and their children; not the launcher, nor a fork of
it before its exec) are held to ``memory_per_slot`` by polling their RSS in :meth:`TrialRunner.wait`.
:func:`run_to_completion` runs a job that is not a trial (the full experiment) with the same care.

Example::

    with TrialRunner(settings, output_dir=out) as runner:       # Ctrl-C: nothing is left running
        runner.start(spec, ds_config=cfg, hparams=hparams)
        for result in runner.wait():
            print(result.status, result.metrics)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from toolkit.config import OUTPUT_DIR_ENV, TRIAL_HPARAMS_ENV
from toolkit.ds_shm import remove_buffers
from toolkit.dsat.hosts import Host, format_include, is_local_host, place_trial
from toolkit.dsat.launcher import (LAUNCHERS, LOOPBACK, MULTIHOST_LAUNCHERS, build_multihost_argv,
                                   build_remote_kill_argv, build_trial_argv)
from toolkit.dsat.procs import (RUN_ENV, block_interrupts, find_trial_processes, free_port, kill_until_gone,
                                is_rank_process, rss_bytes, run_to_completion, scan_processes,
                                unblock_interrupts)
from toolkit.dsat.types import METRICS, TRIAL_ENV, ProfileInfo, TrialContract, TrialResult, TrialSpec, TrialStatus
from toolkit.errors import ConfigError

__all__ = ["RunnerSettings", "TrialRunner", "find_trial_processes", "free_port", "run_to_completion", "RUN_ENV"]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
_STDERR_LINES = 5
_LAUNCHER_EPILOGUE = ("] failed (exitcode:", "ChildFailedError", "exits with return code")



def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """How trials are launched and limited. Validated on construction.

    Attributes:
        entrypoint: the experiment's entrypoint argv, e.g. ``("python3", "train.py")``.
        model_dir: the trial's working directory (where the entrypoint lives).
        slots_per_trial: processes (GPUs) per trial.
        max_slots: slots in use at once, over all trials.
        max_concurrent: trials running at once.
        timeout_s: wall-clock limit of one trial, from its start.
        launcher: ``"torchrun"`` or ``"deepspeed"``.
        memory_per_slot: CPU budget in bytes per worker process, enforced on its RSS; None: none.
        start_profile_step, end_profile_step: the timed steps (``steps_completed`` values, both
            included; FLOPs are counted on the step before, so start >= 1).
        gpus: the GPUs to hand out, numbered as this process sees them (``torch.cuda``
            numbering): under an inherited ``CUDA_VISIBLE_DEVICES`` (Slurm sets one) index i
            means its i-th entry. Each trial gets its share through ``CUDA_VISIBLE_DEVICES``.
            None on CPU.
        grace_s: SIGTERM-to-SIGKILL grace when killing a trial.
        poll_s: how often running trials are checked (exit, timeout, memory).
        hosts: the machines and their slots (``--hostfile`` or the Slurm allocation); None: this
            machine alone (the single-machine path: ``max_slots`` local slots, no ssh). With
            hosts, each trial is placed with :func:`toolkit.dsat.hosts.place_trial` and records
            its hosts in ``placement.json``; a trial whose hosts are all this machine (loopback
            names, this host name) is started locally as without hosts, any other through
            ``multihost_launcher``.
        multihost_launcher: one of :data:`~toolkit.dsat.launcher.MULTIHOST_LAUNCHERS`.
        ssh_port: ssh port of the hosts (DeepSpeed's runners), None for ssh's default.
    """

    entrypoint: tuple[str, ...]
    model_dir: Path
    slots_per_trial: int
    max_slots: int
    max_concurrent: int
    timeout_s: float
    launcher: str = "torchrun"
    memory_per_slot: int | None = None
    start_profile_step: int = 3
    end_profile_step: int = 5
    gpus: tuple[int, ...] | None = None
    grace_s: float = 5.0
    poll_s: float = 0.25
    hosts: tuple[Host, ...] | None = None
    multihost_launcher: str = "pdsh"
    ssh_port: int | None = None

    def __post_init__(self) -> None:
        # Normalise containers (lists from argparse/YAML) before the checks; frozen, hence object.__setattr__.
        if isinstance(self.entrypoint, (list, tuple)):
            object.__setattr__(self, "entrypoint", tuple(self.entrypoint))
        if isinstance(self.model_dir, (str, os.PathLike)):
            object.__setattr__(self, "model_dir", Path(self.model_dir))
        if isinstance(self.gpus, list):
            object.__setattr__(self, "gpus", tuple(self.gpus))
        if isinstance(self.hosts, list):
            object.__setattr__(self, "hosts", tuple(self.hosts))
        p: list[str] = []
        ep = self.entrypoint
        if not isinstance(ep, tuple) or not ep or not all(isinstance(x, str) and x for x in ep):
            p.append(f"entrypoint={ep!r}: expected a non-empty list of strings, e.g. ('python3', 'train.py')")
        if not isinstance(self.model_dir, Path) or not self.model_dir.is_dir():
            p.append(f"model_dir={str(self.model_dir)!r}: expected an existing directory (the entrypoint's)")
        for name in ("slots_per_trial", "max_slots", "max_concurrent"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                p.append(f"{name}={value!r}: expected an integer >= 1")
        if _is_int(self.slots_per_trial) and _is_int(self.max_slots) and self.max_slots < self.slots_per_trial:
            p.append(f"max_slots={self.max_slots} < slots_per_trial={self.slots_per_trial}: no trial could "
                     "ever start; raise max_slots or lower slots_per_trial")
        for name in ("timeout_s", "grace_s", "poll_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value <= 0:
                p.append(f"{name}={value!r}: expected a number of seconds > 0")
        if self.launcher not in LAUNCHERS:
            p.append(f"launcher={self.launcher!r}: expected one of {', '.join(LAUNCHERS)}")
        if self.memory_per_slot is not None and (not _is_int(self.memory_per_slot) or self.memory_per_slot < 1):
            p.append(f"memory_per_slot={self.memory_per_slot!r}: expected a number of bytes >= 1, or None")
        s, e = self.start_profile_step, self.end_profile_step
        if not (_is_int(s) and _is_int(e) and 1 <= s <= e):
            p.append(f"start_profile_step={s!r}, end_profile_step={e!r}: expected integers with "
                     "1 <= start <= end (step start-1 counts the FLOPs)")
        if self.gpus is not None:
            g = self.gpus
            if not isinstance(g, tuple) or not all(_is_int(x) and x >= 0 for x in g) or len(set(g)) != len(g):
                p.append(f"gpus={g!r}: expected distinct GPU ids >= 0, or None on CPU")
            elif _is_int(self.max_slots) and self.max_slots > len(g) and self.hosts is None:
                p.append(f"max_slots={self.max_slots} but only {len(g)} GPU(s) given ({g}); lower max_slots "
                         "or give more GPUs")
        p.extend(self._host_problems())
        if not p:  # the entrypoint must be launchable: say so now, not at the first trial
            try:
                build_trial_argv(list(ep), launcher=self.launcher, nproc=self.slots_per_trial, master_port=29500)
            except ConfigError as err:
                p.extend(err.problems)
        if p:
            raise ConfigError(p)


    def _host_problems(self) -> list[str]:
        if self.multihost_launcher not in MULTIHOST_LAUNCHERS:
            return [f"multihost_launcher={self.multihost_launcher!r}: expected one of {', '.join(MULTIHOST_LAUNCHERS)}"]
        if self.ssh_port is not None and (not _is_int(self.ssh_port) or not 1 <= self.ssh_port <= 65535):
            return [f"ssh_port={self.ssh_port!r}: expected a port in 1..65535, or None"]
        if self.hosts is None:
            return []
        hosts = self.hosts
        if not isinstance(hosts, tuple) or not hosts or not all(isinstance(h, Host) for h in hosts) \
                or len({h.name for h in hosts}) != len(hosts):
            return [f"hosts={hosts!r}: expected distinct Host entries (toolkit.dsat.hosts), or None"]
        total = sum(h.slots for h in hosts)
        if _is_int(self.max_slots) and self.max_slots > total:
            return [f"max_slots={self.max_slots} but the hosts have {total} slot(s) in all; lower max_slots"]
        if _is_int(self.slots_per_trial) and place_trial(
                {h.name: tuple(range(h.slots)) for h in hosts}, self.slots_per_trial,
                uniform=self.multihost_launcher == "srun") is None:
            slots = {h.name: h.slots for h in hosts}
            return [f"slots_per_trial={self.slots_per_trial} cannot be placed on the hosts {slots}"
                    + (" with the same number of slots on each host (srun)" if self.multihost_launcher == "srun"
                       else "")]
        return []


def _device_ids(gpus: tuple[int, ...] | None) -> dict[int, str] | None:
    """gpus (this process's numbering) -> the values to put in a trial's CUDA_VISIBLE_DEVICES."""
    if gpus is None:
        return None
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return {g: str(g) for g in gpus}
    missing = [g for g in gpus if g >= len(visible)]
    if missing:
        raise ValueError(f"gpus={gpus} but CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} makes only "
                         f"{len(visible)} GPU(s) visible (indices 0..{len(visible) - 1}); gpus are indices into it")
    return {g: visible[g] for g in gpus}


@dataclasses.dataclass
class _Trial:
    spec: TrialSpec
    directory: Path
    mark: str       # the trial's TOOLKIT_DSAT_TRIAL value
    process: subprocess.Popen
    gpus: tuple[int, ...] | None
    port: int
    started: float
    verdict: tuple[TrialStatus, str] | None = None
    placement: dict[str, tuple[int, ...]] | None = None   # with hosts: host -> slot ids
    via: str | None = None                                 # the multihost launcher; None: local


def _without(free: Mapping[str, tuple[int, ...]], placement: Mapping[str, Iterable[int]]
             ) -> dict[str, tuple[int, ...]]:
    """``free`` (host -> slot ids) less the slots of ``placement``; a new dict. Pure."""
    return {h: tuple(i for i in ids if i not in placement.get(h, ())) for h, ids in free.items()}


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _stderr_tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(fh.seek(0, os.SEEK_END) - 16384, 0))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.rstrip()[:300] for line in text.splitlines() if line.strip()]
    # The launcher's own epilogue (torchrun's ChildFailedError table) hides the worker's error.
    ends = [i for i, line in enumerate(lines) if any(m in line for m in _LAUNCHER_EPILOGUE)]
    if ends and ends[0] > 0:
        lines = lines[:ends[0]]
    lines = lines[-_STDERR_LINES:]
    return ("\nlast lines of stderr:\n  " + "\n  ".join(lines)) if lines else ""


def _check_result(data: Any, spec: TrialSpec) -> str | None:
    """What is wrong with a result file's content, or None."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    if data.get("trial_id") != spec.trial_id:
        return f"trial_id={data.get('trial_id')!r}, expected {spec.trial_id}"
    status = data.get("status")
    if status not in ("ok", "oom", "failed"):
        return f"status={status!r}, expected 'ok', 'oom' or 'failed'"
    if status != "ok":
        return None
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        return f"metrics={metrics!r:.80}, expected an object with {', '.join(METRICS)}"
    for name in METRICS:
        value = metrics.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            return f"metric {name}={value!r}: expected a finite number >= 0"
    profile = data.get("profile")
    if spec.profile or profile is not None:
        try:
            info = ProfileInfo.from_json(profile)
        except (TypeError, AttributeError) as err:
            return f"profile={profile!r:.120}: {err}"
        if not all(_is_int(getattr(info, f)) and getattr(info, f) >= 0 for f in
                   ("num_params", "trainable_params", "activation_bytes_per_example", "memory_per_slot",
                    "baseline_bytes")):
            return f"profile={profile!r:.200}: expected integer counts >= 0"
    return None


class TrialRunner:
    """Launches trials within the slot and concurrency caps and reports how each ended.

    Use it from one process (the autotuner's; no collectives, not on training ranks), as a
    context manager; :meth:`shutdown` (also on ``__exit__``) kills every trial's processes and is
    safe to call twice or from a signal handler. Processes left marked under ``output_dir`` by an
    autotuner that was killed outright (SIGKILL) are killed on construction, before ``--resume``
    starts new trials beside them.
    """

    def __init__(self, settings: RunnerSettings, *, output_dir: Path) -> None:
        if not isinstance(settings, RunnerSettings):
            raise TypeError(f"settings must be a RunnerSettings, got {type(settings).__name__}")
        self.settings = settings
        self.trials_dir = Path(output_dir).resolve() / "trials"
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        self._running: dict[int, _Trial] = {}
        self._free_gpus = list(settings.gpus) if settings.gpus is not None else None
        self._device_ids = _device_ids(settings.gpus)
        self._free_slots = ({h.name: tuple(range(h.slots)) for h in settings.hosts}
                            if settings.hosts is not None else None)
        self._closed = False
        leftovers = find_trial_processes(f"{self.trials_dir}{os.sep}", prefix=True)
        if leftovers:
            logger.warning("killing %d process(es) left by an earlier run of trials in %s: %s", len(leftovers),
                           self.trials_dir, sorted(leftovers))
            self._terminate([], sweep=True)

    def __enter__(self) -> "TrialRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def running(self) -> int:
        """Trials started and not yet returned by :meth:`wait`. Autotuner process only."""
        return len(self._running)

    def capacity(self) -> int:
        """How many more trials may start now (0 after :meth:`shutdown`). Autotuner process only."""
        if self._closed:
            return 0
        s = self.settings
        free_slots = s.max_slots - s.slots_per_trial * len(self._running)
        count = max(0, min(s.max_concurrent - len(self._running), free_slots // s.slots_per_trial))
        if self._free_slots is not None:  # what placement allows: slots of a host are not pooled
            free, placed = dict(self._free_slots), 0
            while placed < count:
                chosen = place_trial(free, s.slots_per_trial, uniform=s.multihost_launcher == "srun")
                if chosen is None:
                    break
                free = _without(free, chosen)
                placed += 1
            count = placed
        return count

    def start(self, spec: TrialSpec, *, ds_config: Mapping[str, Any], hparams: Mapping[str, Any]) -> None:
        """Launch one trial on free slots; returns at once. Autotuner process only.

        Args:
            spec: the trial; ``spec.trial_id`` names its directory (files of an earlier run of
                the same id are replaced, its stale result removed).
            ds_config: the trial's complete DeepSpeed config (written, not changed).
            hparams: the experiment's hyperparameters; written with ``deepspeed_config`` set to
                the trial's ``ds_config.json`` and without ``overwrite_deepspeed_args``.

        Raises:
            RuntimeError: no capacity (call :meth:`wait` first) or the runner was shut down.
            ValueError: a trial with this id is running.
        """
        s = self.settings
        if self._closed:
            raise RuntimeError("the trial runner was shut down; make a new one")
        if spec.trial_id in self._running:
            raise ValueError(f"trial {spec.trial_id} is already running; trial ids must be unique")
        if self.capacity() < 1:
            raise RuntimeError(f"no free capacity: {len(self._running)} trial(s) running on "
                               f"{len(self._running) * s.slots_per_trial} of {s.max_slots} slots "
                               f"(max_concurrent={s.max_concurrent}); call wait() first")
        directory = self.trials_dir / f"trial_{spec.trial_id}"
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("result.json*"):
            stale.unlink(missing_ok=True)
        shutil.rmtree(directory / "output", ignore_errors=True)  # no checkpoint of an earlier run to resume
        ds_path, hp_path, contract_path = (directory / n for n in ("ds_config.json", "hparams.json", "trial.json"))
        ds_path.write_text(json.dumps(ds_config, indent=2), encoding="utf-8")
        trial_hparams = copy.deepcopy(dict(hparams))
        trial_hparams.pop("overwrite_deepspeed_args", None)
        trial_hparams["deepspeed_config"] = str(ds_path)
        hp_path.write_text(json.dumps(trial_hparams, indent=2), encoding="utf-8")
        TrialContract(trial_id=spec.trial_id, result_path=str(directory / "result.json"),
                      start_profile_step=s.start_profile_step, end_profile_step=s.end_profile_step,
                      profile=spec.profile, memory_per_slot=s.memory_per_slot).write(contract_path)

        gpus = placement = via = None
        if self._free_slots is not None:
            placement = place_trial(self._free_slots, s.slots_per_trial, uniform=s.multihost_launcher == "srun")
            if placement is None:  # capacity() >= 1 said it fits: a bug if reached
                raise RuntimeError(f"trial {spec.trial_id} does not fit the free slots {self._free_slots}")
            self._take(placement)
            if not all(is_local_host(h) for h in placement):
                via = s.multihost_launcher
            elif s.gpus is not None and len(placement) == 1:  # this machine: slot ids are its GPU ids
                gpus = next(iter(placement.values()))
        elif self._free_gpus is not None:
            gpus, self._free_gpus = tuple(self._free_gpus[:s.slots_per_trial]), self._free_gpus[s.slots_per_trial:]
        try:
            env = dict(os.environ)
            # OUTPUT_DIR_ENV: the trial's own checkpoints and logs (toolkit.get_output_dir), never shared
            # with a concurrent trial or picked up by a later one as something to resume from.
            env.update({TRIAL_HPARAMS_ENV: str(hp_path), TRIAL_ENV: str(contract_path), "PYTHONUNBUFFERED": "1",
                        OUTPUT_DIR_ENV: str(directory / "output")})
            # Trials share the cores: without a limit every rank starts one OpenMP thread per core.
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // s.max_slots)))
            include = None
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(self._device_ids.get(g, str(g)) for g in gpus)
                if s.launcher == "deepspeed":  # it sets CUDA_VISIBLE_DEVICES of each rank from these
                    include = f"localhost:{env['CUDA_VISIBLE_DEVICES']}"
            port = self._free_port()
            if via is None:
                argv = build_trial_argv(list(s.entrypoint), launcher=s.launcher, nproc=s.slots_per_trial,
                                        master_port=port, include=include)
            else:
                argv = self._multihost_argv(directory, placement, via, port, env)
            if placement is not None:
                (directory / "placement.json").write_text(json.dumps({
                    "hosts": {h: list(ids) for h, ids in placement.items()}, "launch": via or "local",
                    "include": format_include(placement), "master_port": port, "argv": argv}, indent=2),
                    encoding="utf-8")
            with open(directory / "stdout.log", "wb") as out, open(directory / "stderr.log", "wb") as err:
                process = subprocess.Popen(argv, cwd=s.model_dir, env=env, stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=err, start_new_session=True)
        except BaseException:
            if placement is not None:
                self._give_back(placement)
            elif gpus is not None:
                self._free_gpus = sorted(self._free_gpus + list(gpus))
            raise
        self._running[spec.trial_id] = _Trial(spec, directory, str(contract_path), process, gpus,
                                              port, time.monotonic(), placement=placement, via=via)
        logger.info("trial %d started (pid %d, port %d%s%s): %s", spec.trial_id, process.pid, port,
                    f", GPUs {gpus}" if gpus else "", f", hosts {format_include(placement)}" if placement else "",
                    " ".join(argv))

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        """Block until at least one running trial has ended, or ``timeout`` seconds. Autotuner process only.

        Trials past their timeout or over the memory budget are killed here, so call it
        whenever the autotuner has nothing else to do. Returns at once with ``[]`` when no
        trial is running.

        Returns:
            The results of the trials that ended (each returned once), possibly empty.
        """
        end = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        while True:
            finished = self._poll()
            if finished or not self._running:
                return finished
            now = time.monotonic()
            if end is not None and now >= end:
                return []
            time.sleep(self.settings.poll_s if end is None else max(min(self.settings.poll_s, end - now), 0.0))

    def shutdown(self) -> None:
        """Kill every running trial's processes and wait for them. Idempotent. Autotuner process only."""
        self._closed = True
        trials = list(self._running.values())
        masked = block_interrupts()
        try:
            if trials:
                logger.info("stopping %d running trial(s)", len(trials))
            self._terminate(trials, sweep=True)
            for trial in trials:
                self._release(trial)
        finally:
            unblock_interrupts(masked)

    # -- internals ---------------------------------------------------------------------------

    def _take(self, placement: Mapping[str, tuple[int, ...]]) -> None:
        self._free_slots = _without(self._free_slots, placement)

    def _give_back(self, placement: Mapping[str, tuple[int, ...]]) -> None:
        self._free_slots = {h: tuple(sorted(set(ids) | set(placement.get(h, ()))))
                            for h, ids in self._free_slots.items()}

    def _multihost_argv(self, directory: Path, placement: Mapping[str, tuple[int, ...]], via: str, port: int,
                        env: dict[str, str]) -> list[str]:
        """Argv of a trial on other hosts; its hostfile and exported variables go to its directory.

        DeepSpeed's runners pass on only some variables (PYTHON*, UCX*, ...) plus those of the
        file named by ``DS_ENV_FILE``: the trial's marks, hyperparameters and output directory
        go there, so every rank on every host carries them. srun exports everything.
        """
        s = self.settings
        if via == "srun":
            return build_multihost_argv(list(s.entrypoint), placement=placement, via=via, master_port=port,
                                        gpus=s.gpus is not None)
        hostfile = directory / "hostfile"
        hostfile.write_text("".join(f"{h} slots={len(ids)}\n" for h, ids in placement.items()), encoding="utf-8")
        exported = {k: env[k] for k in (TRIAL_HPARAMS_ENV, TRIAL_ENV, OUTPUT_DIR_ENV, "PYTHONUNBUFFERED",
                                        "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "PATH") if k in env}
        env_file = directory / "ds_env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in exported.items()), encoding="utf-8")
        env["DS_ENV_FILE"] = str(env_file)
        if via == "pdsh":
            env["PDSH_RCMD_TYPE"] = "ssh"
        return build_multihost_argv(list(s.entrypoint), placement=placement, via=via, master_port=port,
                                    hostfile=hostfile, ssh_port=s.ssh_port)

    def _stop_remote(self, trial: _Trial) -> None:
        """Stop a running pdsh trial on its hosts: only its own launchers (see build_remote_kill_argv).

        DeepSpeed's runner is killed first with SIGKILL, because its SIGTERM handler would
        ``pkill`` every DeepSpeed launcher on those hosts, other trials' included; the sweep of
        :meth:`_terminate` then ends what is left on this machine (pdsh, ssh clients).
        """
        if trial.via != "pdsh" or trial.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            trial.process.kill()
        argv = build_remote_kill_argv(list(trial.placement), master_port=trial.port, ssh_port=self.settings.ssh_port)
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh")
        if self.settings.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {self.settings.ssh_port}".strip()
        try:
            subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=max(self.settings.grace_s, 10.0), check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            logger.warning("trial %d: stopping it on %s failed (%s); its ranks there may live on until their "
                           "rendezvous times out", trial.spec.trial_id, ",".join(trial.placement), err)

    def _free_port(self) -> int:
        in_use = {t.port for t in self._running.values()}
        for _ in range(100):
            port = free_port()
            if port not in in_use:
                return port
        raise RuntimeError("could not find a free TCP port on 127.0.0.1")

    def _members(self, trial: _Trial, table: Mapping[int, tuple[int, bytes]]) -> set[int]:
        # Once reaped, the launcher's pid may belong to someone else: then only the mark counts.
        root = trial.process.pid if trial.process.returncode is None else None
        return find_trial_processes(trial.mark, root=root, table=table)

    def _terminate(self, trials: Iterable[_Trial], *, sweep: bool = False) -> bool:
        """Kill the processes of ``trials`` until none is left.

        ``sweep``: also every process marked with any trial under this runner's directory (one
        started by a :meth:`start` that an interrupt cut short before it was recorded).
        """
        trials = list(trials)
        for trial in trials:
            self._stop_remote(trial)

        def find(table: Mapping[int, tuple[int, bytes]]) -> set[int]:
            alive = set().union(*(self._members(t, table) for t in trials))
            if sweep:
                alive |= find_trial_processes(f"{self.trials_dir}{os.sep}", prefix=True, table=table)
            return alive
        return kill_until_gone(find, grace_s=self.settings.grace_s, reap=[t.process for t in trials],
                                what=f"trial(s) {[t.spec.trial_id for t in trials]}")

    def _release(self, trial: _Trial) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            trial.process.wait(timeout=self.settings.grace_s)
        if trial.via is None:  # ranks on this machine, rendezvous on 127.0.0.1 (see start)
            # DeepSpeed never removes its CPU all-reduce segments; a trial that did not use
            # toolkit.init_distributed, or died during start-up, leaves 69 MB per rank in /dev/shm.
            remove_buffers(addr=LOOPBACK, port=trial.port)
        if self._running.pop(trial.spec.trial_id, None) is not None:
            if trial.placement is not None:
                self._give_back(trial.placement)
            elif trial.gpus is not None:
                self._free_gpus = sorted(self._free_gpus + list(trial.gpus))

    def _poll(self) -> list[TrialResult]:
        s = self.settings
        finished = []
        table = scan_processes()
        for trial in list(self._running.values()):
            code = trial.process.poll()
            if code is None:
                if time.monotonic() - trial.started > s.timeout_s:
                    trial.verdict = (TrialStatus.TIMEOUT, f"ran past the timeout of {s.timeout_s:g} s")
                elif s.memory_per_slot is not None:
                    for pid in self._members(trial, table) - {trial.process.pid}:
                        if not is_rank_process(table[pid][1]):  # the launcher's fork before its exec
                            continue
                        rss = rss_bytes(pid)
                        if rss > s.memory_per_slot:
                            trial.verdict = (TrialStatus.OOM, f"RSS {rss / _MIB:.0f} MiB exceeded the memory "
                                             f"budget {s.memory_per_slot / _MIB:.0f} MiB per slot")
                            break
                if trial.verdict is None:
                    continue
                logger.info("trial %d: %s; killing its processes", trial.spec.trial_id, trial.verdict[1])
            # Ended, or to be ended: no process of it may outlive it (orphans in their own session too).
            self._terminate([trial])
            self._release(trial)
            finished.append(self._classify(trial, trial.process.returncode))
        return finished

    def _classify(self, trial: _Trial, code: int | None) -> TrialResult:
        spec, duration = trial.spec, time.monotonic() - trial.started

        def result(status: TrialStatus, error: str | None = None, **kw: Any) -> TrialResult:
            if status is TrialStatus.FAILED and error is not None:
                error += _stderr_tail(trial.directory / "stderr.log")
            logger.info("trial %d ended: %s%s", spec.trial_id, status.value, f" ({error})" if error else "")
            return TrialResult(spec, status, duration_s=duration, error=error, **kw)

        if trial.verdict is not None:
            return result(*trial.verdict)
        code = -1 if code is None else code  # not reaped within the grace period: treat as killed
        path = trial.directory / "result.json"
        if not path.exists():
            return result(TrialStatus.FAILED, "exited 0 without a result file" if code == 0 else _exit_text(code))
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            return result(TrialStatus.FAILED, f"corrupt result file: {err}")
        problem = _check_result(data, spec)
        if problem is not None:
            return result(TrialStatus.FAILED, f"corrupt result file: {problem}")
        if data["status"] == "oom":
            return result(TrialStatus.OOM, str(data.get("error") or "out of memory (reported by the trial)"))
        if data["status"] == "failed":  # the trial's own reason; an exit status says more if there is one
            return result(TrialStatus.FAILED, _exit_text(code) if code else str(data.get("error") or "failed"))
        if code != 0:
            return result(TrialStatus.FAILED, f"{_exit_text(code)} (after writing its result)")
        metrics = {name: float(data["metrics"][name]) for name in METRICS}
        return result(TrialStatus.OK, metrics=metrics, profile=data.get("profile"))


