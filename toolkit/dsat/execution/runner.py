"""Run dsat trials as real processes: launch, watch, classify, and leave nothing behind.

The only module of toolkit that spawns trials (the orchestrator drives it). How a trial is started,
marked, held to its budget and killed: docs/design-dsat-runner.md#running-a-trial. Example::

    with TrialRunner(settings, output_dir=out) as runner:       # Ctrl-C: nothing is left running
        runner.start(spec, ds_config=cfg, hparams=hparams)
        results = runner.wait()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from toolkit._files import atomic_write_json
from toolkit.checkpoint.stop_record import STOP_FILE, STOP_RECORD_ENV
from toolkit.dsat.contract import PROGRESS_FILE, TrialStatus, trial_hparams
from toolkit.dsat.execution.classify import TrialPreempted, classify, preemption_of
from toolkit.dsat.execution.multihost_argv import (
    build_multihost_argv,
    build_remote_kill_argv,
    with_config_flag,
)
from toolkit.dsat.execution.settings import CONFIG_READS_ENV, CPU_ALLOCATOR_ENV, RunnerSettings
from toolkit.dsat.execution.watch import heartbeat_text, peak_bytes, read_progress
from toolkit.dsat.hf_trainer import with_batch_flags
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.dsat.trial.cpu_info import CPUINFO_ENV, measure_into
from toolkit.dsat.trial.site import site_pythonpath
from toolkit.launch.argv import LOOPBACK, build_trial_argv
from toolkit.launch.hosts import format_include
from toolkit.launch.output import OutputPump
from toolkit.launch.procs import (
    block_interrupts,
    find_trial_processes,
    free_port,
    is_rank_process,
    kill_until_gone,
    rss_bytes,
    scan_processes,
    unblock_interrupts,
)
from toolkit.launch.slots import SlotPool, Slots, device_ids
from toolkit.runtime.build_env import build_processes
from toolkit.runtime.ds_shm import remove_buffers
from toolkit.runtime.op_builds import builders_for, clear_dead_locks, load_ops
from toolkit.runtime.trial_env import (
    EXPERIMENT_CONFIG_ENV,
    OUTPUT_DIR_ENV,
    TRIAL_ENV,
    TRIAL_HPARAMS_ENV,
)

__all__ = ["RunnerSettings", "TrialRunner"]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclasses.dataclass
class _Trial:
    spec: TrialSpec
    directory: Path
    mark: str       # the trial's TOOLKIT_DSAT_TRIAL value
    process: subprocess.Popen
    slots: Slots    # its GPUs, or its placement on the hosts and the multihost launcher (None: local)
    port: int
    started: float
    output: OutputPump
    verdict: tuple[TrialStatus, str] | None = None
    builds_seen: set[str] = dataclasses.field(default_factory=set)   # op directories a rank built in
    peak: int = 0        # the largest VmHWM of its ranks seen so far (on this machine)
    beat: float = 0.0    # when its last heartbeat was logged (time.monotonic)


class TrialRunner:
    """Launches trials within the slot and concurrency caps and reports how each ended. Autotuner
    process only, as a context manager: :meth:`shutdown` (also on exit; idempotent, safe from a signal
    handler) kills every trial. Processes a SIGKILLed autotuner left marked under ``output_dir`` are
    killed on construction, before ``--resume`` starts trials beside them."""

    def __init__(self, settings: RunnerSettings, *, output_dir: Path) -> None:
        if not isinstance(settings, RunnerSettings):
            raise TypeError(f"settings must be a RunnerSettings, got {type(settings).__name__}")
        self.settings = settings
        self.trials_dir = Path(output_dir).resolve() / "trials"
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        self._running: dict[int, _Trial] = {}
        self._slots = SlotPool(slots_per_trial=settings.slots_per_trial, gpus=settings.gpus,
                               hosts=settings.hosts, multihost_launcher=settings.multihost_launcher)
        self._device_ids = device_ids(settings.gpus)
        self._closed = False
        self._ops_ready: set[str] = set()
        self._cpu_info: Path | None | bool = False  # py-cpuinfo's answer file; False: not measured yet
        leftovers = find_trial_processes(f"{self.trials_dir}{os.sep}", prefix=True)
        if leftovers:
            logger.warning("killing %d process(es) left by an earlier run of trials in %s: %s",
                           len(leftovers),
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
        return self._slots.placeable(count)  # what placement on the hosts allows

    def start(self, spec: TrialSpec, *, ds_config: Mapping[str, Any], hparams: Mapping[str, Any]) -> None:
        """Launch one trial on free slots; returns at once. Autotuner process only.

        ``spec.trial_id`` names its directory (an earlier run's files there are replaced); ``ds_config`` is
        written as given; ``hparams`` reach the trial as :func:`~toolkit.dsat.contract.trial_hparams`
        makes them. ValueError when called out of order: no capacity (:meth:`wait` first), shut down, or
        the id already running."""
        self._check_can_start(spec)
        cpu_info = self._cpu_info_file()
        self._build_ops(ds_config)
        directory = self._prepare_directory(spec, ds_config=ds_config, hparams=hparams)
        slots = self._slots.take(trial_id=spec.trial_id)
        # the launcher's own lines are shown at a failure's end; across hosts the ranks' come through it
        output = OutputPump(directory, label=f"trial {spec.name}", echo=self.settings.echo, fresh=True,
                            echo_launcher=slots.via is not None)
        try:
            env, include = self._trial_env(directory, slots.gpus)
            if cpu_info is not None and slots.via is None:  # this machine's answer, for its ranks only
                env[CPUINFO_ENV] = str(cpu_info)
            port = self._free_port()
            # the entrypoint's --deepspeed_config / --deepspeed names this trial's own config file
            entrypoint = with_config_flag(self.settings.entrypoint, directory / "ds_config.json")
            if self.settings.hf_batch_flags:  # the Trainer's own flags, which its data loader follows
                entrypoint = with_batch_flags(entrypoint, ds_config)
            if slots.via is not None and slots.placement is not None:
                argv = self._multihost_argv(directory, slots.placement, slots.via, port, env, entrypoint)
            else:
                s = self.settings
                argv = build_trial_argv(entrypoint, launcher=s.launcher, nproc=s.slots_per_trial,
                                        master_port=port, include=include, rank_logs=output.ranks_dir)
            if slots.placement is not None:
                atomic_write_json(directory / "placement.json", {
                    "hosts": {h: list(ids) for h, ids in slots.placement.items()},
                    "launch": slots.via or "local",
                    "include": format_include(slots.placement), "master_port": port, "argv": argv})
            with output.launcher_file() as out:
                process = subprocess.Popen(argv, cwd=self.settings.model_dir, env=env,
                                           stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        except BaseException:
            output.stop()
            self._slots.give_back(slots)
            raise
        output.start()
        now = time.monotonic()
        self._running[spec.trial_id] = _Trial(spec, directory, env[TRIAL_ENV], process, slots, port, now,
                                              output, beat=now)
        logger.info("trial %s started (%s, pid %d, port %d%s%s): %s", spec.name, directory.name,
                    process.pid, port,
                    f", GPUs {slots.gpus}" if slots.gpus else "",
                    f", hosts {format_include(slots.placement)}" if slots.placement else "", " ".join(argv))

    def _cpu_info_file(self) -> Path | None:
        """py-cpuinfo's answer for this machine, measured at the first start (also this process's answer),
        so that no trial rank measures it again (:mod:`toolkit.dsat.trial.cpu_info`). None: not measurable."""
        if self._cpu_info is False:
            self._cpu_info = measure_into(self.trials_dir.parent / "cpuinfo.json")  # trials/: trial_* only
        return self._cpu_info if isinstance(self._cpu_info, Path) else None

    def _build_ops(self, ds_config: Mapping[str, Any]) -> None:
        """Build the DeepSpeed ops this trial's engine loads here, before it starts: no trial
        compiles, so no compiler counts in its memory budget, timeout or start-up time."""
        needed = [b for b in builders_for([ds_config], on_cpu=self.settings.gpus is None)
                  if b not in self._ops_ready]
        if needed:
            load_ops(needed)
            self._ops_ready.update(needed)

    def _check_can_start(self, spec: TrialSpec) -> None:
        s = self.settings
        if self._closed:
            raise ValueError("the trial runner was shut down; make a new one")
        if spec.trial_id in self._running:
            raise ValueError(f"trial {spec.trial_id} is already running; trial ids must be unique")
        if self.capacity() < 1:
            raise ValueError(f"no free capacity: {len(self._running)} trial(s) running on "
                               f"{len(self._running) * s.slots_per_trial} of {s.max_slots} slots "
                               f"(max_concurrent={s.max_concurrent}); call wait() first")

    def _prepare_directory(self, spec: TrialSpec, *, ds_config: Mapping[str, Any],
                           hparams: Mapping[str, Any]) -> Path:
        """The trial's directory with its config, hyperparameters and contract; nothing of an earlier run."""
        s = self.settings
        directory = self.trials_dir / f"trial_{spec.trial_id}"
        directory.mkdir(parents=True, exist_ok=True)
        for stale in [*directory.glob("result.json*"), directory / PROGRESS_FILE]:
            stale.unlink(missing_ok=True)
        shutil.rmtree(directory / "output", ignore_errors=True)  # no checkpoint of an earlier run to resume
        ds_path = directory / "ds_config.json"
        atomic_write_json(ds_path, ds_config)
        atomic_write_json(directory / "hparams.json",
                          trial_hparams(hparams, ds_config=ds_config, ds_config_path=ds_path))
        s.trial_contract(spec.trial_id, result_path=directory / "result.json",
                         profile=spec.profile, ds_config=ds_path).write(directory / "trial.json")
        return directory

    def _trial_env(self, directory: Path, gpus: tuple[int, ...] | None) -> tuple[dict[str, str], str | None]:
        """The trial's environment (its marks, files and GPUs), and DeepSpeed's ``--include`` if any."""
        s = self.settings
        env = dict(os.environ)
        # OUTPUT_DIR_ENV: the trial's own checkpoints and logs (toolkit.get_output_dir), never shared
        # with a concurrent trial or picked up by a later one as something to resume from.
        env.update({TRIAL_HPARAMS_ENV: str(directory / "hparams.json"),
                    TRIAL_ENV: str(directory / "trial.json"), STOP_RECORD_ENV: str(directory / STOP_FILE),
                    "PYTHONUNBUFFERED": "1", OUTPUT_DIR_ENV: str(directory / "output")})
        # the trial bootstrap (toolkit.dsat.trial.site): deepspeed.initialize gets the trial's config
        env["PYTHONPATH"] = site_pythonpath(env.get("PYTHONPATH"))
        env.pop(CONFIG_READS_ENV, None)
        if s.merge_config and s.config_files:  # a script that reads its own config file reads the trial's
            env[CONFIG_READS_ENV] = os.pathsep.join(str(p) for p in s.config_files)
        if s.experiment_config is not None:
            env[EXPERIMENT_CONFIG_ENV] = str(s.experiment_config)
            # The YAML's environment.environment_variables, for every rank (as Determined's containers);
            # read per trial (a small file), refused with a ConfigError naming the entry; a YAML not
            # (yet) there gives none: the trial's own read of it says so.
            from toolkit.bounded_load import load_yaml
            from toolkit.launch.experiment_env import environment_variables

            try:
                experiment = load_yaml(Path(s.experiment_config), what="experiment config") or {}
            except FileNotFoundError:
                experiment = {}
            if isinstance(experiment, Mapping):
                env.update(environment_variables(experiment, device="cpu" if gpus is None else "cuda"))
        # Trials share the cores: without a limit every rank starts one OpenMP thread per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // s.max_slots)))
        for key, value in CPU_ALLOCATOR_ENV if s.memory_per_slot is not None else ():
            env.setdefault(key, value)  # a peak resident size linear in the micro-batch (see there)
        if gpus is None:
            return env, None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self._device_ids.get(g, str(g)) for g in gpus)
        # the deepspeed launcher sets CUDA_VISIBLE_DEVICES of each rank from --include
        include = f"localhost:{env['CUDA_VISIBLE_DEVICES']}" if s.launcher == "deepspeed" else None
        return env, include

    def wait(self, timeout: float | None = None) -> list[TrialResult]:
        """Block until at least one running trial has ended (or ``timeout`` s); the results of those that
        ended, each once (``[]`` at once when none runs). Trials past their timeout or over the memory
        budget are killed here: call it whenever idle. Autotuner process only."""
        end = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        while True:
            finished = self._poll()
            if finished or not self._running:
                return finished
            now = time.monotonic()
            if end is not None and now >= end:
                return []
            poll = self.settings.poll_s
            self._nap(poll if end is None else max(min(poll, end - now), 0.0))

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, or until a trial's launcher exits (a waitpid every 20 ms), so that
        the end of a trial is seen at once, not at the next poll of the memory and timeouts."""
        until = time.monotonic() + seconds
        while all(t.process.poll() is None for t in self._running.values()):
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.02))

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

    def _multihost_argv(self, directory: Path, placement: Mapping[str, tuple[int, ...]], via: str, port: int,
                        env: dict[str, str], entrypoint: list[str]) -> list[str]:
        """Argv of a trial on other hosts; its hostfile and ``ds_env`` (the variables DeepSpeed's runners
        give every rank through ``DS_ENV_FILE``; srun exports all) go to its directory."""
        s = self.settings
        if via == "srun":
            return build_multihost_argv(entrypoint, placement=placement, via=via, master_port=port,
                                        gpus=s.gpus is not None)
        hostfile = directory / "hostfile"
        hostfile.write_text("".join(f"{h} slots={len(ids)}\n" for h, ids in placement.items()),
                            encoding="utf-8")
        exported = {k: env[k] for k in (TRIAL_HPARAMS_ENV, TRIAL_ENV, OUTPUT_DIR_ENV, EXPERIMENT_CONFIG_ENV,
                                        STOP_RECORD_ENV, "PYTHONUNBUFFERED",
                                        "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "PATH", "PYTHONPATH")
                    if k in env}
        env_file = directory / "ds_env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in exported.items()), encoding="utf-8")
        env["DS_ENV_FILE"] = str(env_file)
        if via == "pdsh":
            env["PDSH_RCMD_TYPE"] = "ssh"
        return build_multihost_argv(entrypoint, placement=placement, via=via, master_port=port,
                                    hostfile=hostfile, ssh_port=s.ssh_port)

    def _stop_remote(self, trial: _Trial) -> None:
        """Stop a running pdsh trial's own launchers on its hosts: its DeepSpeed runner gets SIGKILL first
        (its SIGTERM handler would ``pkill`` every launcher there); :meth:`_terminate` sweeps the rest."""
        hosts = list(trial.slots.placement or ())
        if trial.slots.via != "pdsh" or trial.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            trial.process.kill()
        argv = build_remote_kill_argv(hosts, master_port=trial.port, ssh_port=self.settings.ssh_port)
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh")
        if self.settings.ssh_port is not None:
            extra = env.get("PDSH_SSH_ARGS_APPEND", "")
            env["PDSH_SSH_ARGS_APPEND"] = f"{extra} -p {self.settings.ssh_port}".strip()
        try:
            subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=max(self.settings.grace_s, 10.0), check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            logger.warning("trial %s: stopping it on %s failed (%s); its ranks there may live on until their "
                           "rendezvous times out", trial.spec.name, ",".join(hosts), err)

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
        """Kill the processes of ``trials`` until none is left; ``sweep``: also any process marked with a
        trial under this runner's directory (one an interrupted :meth:`start` did not record)."""
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
        if trial.slots.via is None:  # ranks on this machine, rendezvous on 127.0.0.1 (see start)
            # DeepSpeed never removes its CPU all-reduce segments; a trial that did not use
            # toolkit.init_distributed, or died during start-up, leaves them in /dev/shm.
            remove_buffers(addr=LOOPBACK, port=trial.port)
            clear_dead_locks()  # an op's build lock, if the trial was killed while loading one
        trial.output.stop()  # the launcher is gone: its files are read to their end
        if self._running.pop(trial.spec.trial_id, None) is not None:
            self._slots.give_back(trial.slots)

    def _builds(self, trial: _Trial, members: set[int], table: Mapping[int, tuple[int, bytes]]) -> set[int]:
        """The trial's processes that build an op (a rank's ninja and compilers): not its memory. Said
        once per op and trial; the trial's trial.log says why it was built."""
        building = build_processes(members, {pid: table[pid][0] for pid in members})
        for op_dir in sorted(set(building.values()) - trial.builds_seen - {""}):
            trial.builds_seen.add(op_dir)
            logger.warning("trial %s: its ranks build op %s (in %s); the build's memory is not counted "
                           "against the memory budget, and its trial.log says why it was built",
                           trial.spec.name, os.path.basename(op_dir), op_dir)
        return set(building)

    def _poll(self) -> list[TrialResult]:
        s = self.settings
        finished = []
        table = scan_processes()
        for trial in list(self._running.values()):
            code = trial.process.poll()
            if code is None:
                if time.monotonic() - trial.started > s.timeout_s:
                    trial.verdict = (TrialStatus.TIMEOUT, f"ran past the timeout of {s.timeout_s:g} s")
                elif s.memory_per_slot is not None or s.gpus is None:
                    self._check_memory(trial, table)
                if trial.verdict is None:
                    self._heartbeat(trial)
                    continue
                logger.info("trial %s: %s; killing its processes", trial.spec.name, trial.verdict[1])
            # Ended, or to be ended: no process of it may outlive it (orphans in their own session too).
            self._terminate([trial])
            self._release(trial)
            cause = None if trial.verdict is not None else preemption_of(trial.directory)
            if cause is not None:  # not a result: the trial runs again on --resume
                raise TrialPreempted(f"trial {trial.spec.name} stopped for a preemption ({cause}) before its "
                                     "result")
            result = classify(trial.spec, directory=trial.directory, code=trial.process.returncode,
                              duration_s=time.monotonic() - trial.started, verdict=trial.verdict)
            peak = peak_bytes(trial.peak, read_progress(trial.directory), result.profile)
            result = dataclasses.replace(result, peak_bytes=peak)
            if result.status in (TrialStatus.FAILED, TrialStatus.TIMEOUT):
                why = (result.error or "").split("\n", 1)[0]
                what = f"trial {trial.spec.name} {result.status.value}: {why}"
                logger.warning("%s", trial.output.failure_text(what))
            finished.append(result)
        return finished

    def _check_memory(self, trial: _Trial, table: Mapping[int, tuple[int, bytes]]) -> None:
        """Record the peak resident size of the trial's ranks; over ``memory_per_slot``: its verdict."""
        budget = self.settings.memory_per_slot
        members = self._members(trial, table) - {trial.process.pid}
        for pid in members - self._builds(trial, members, table):   # a rank's op build is not its memory
            if not is_rank_process(table[pid][1]):  # the launcher's fork before its exec
                continue
            peak = rss_bytes(pid, field="VmHWM")
            trial.peak = max(trial.peak, peak)
            if budget is not None and peak > budget:
                trial.verdict = (TrialStatus.OOM, f"peak RSS {peak / _MIB:.0f} MiB exceeded the "
                                 f"memory budget {budget / _MIB:.0f} MiB per slot")
                return

    def _heartbeat(self, trial: _Trial) -> None:
        """Every ``heartbeat_s``: where the running trial is, against its timeout."""
        now = time.monotonic()
        if now - trial.beat < self.settings.heartbeat_s:
            return
        trial.beat = now
        progress = read_progress(trial.directory)
        logger.info("%s", heartbeat_text(trial.spec, elapsed_s=now - trial.started,
                                         timeout_s=self.settings.timeout_s, progress=progress))
