"""How dsat trials are launched and limited: :class:`RunnerSettings`, checked on construction (every
problem in one :class:`~toolkit.errors.ConfigError`). Pure data, built by the CLI; any process.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from toolkit._checks import int_problem, is_int, is_number
from toolkit.dsat.contract import TrialContract
from toolkit.dsat.execution.multihost_argv import MULTIHOST_LAUNCHERS
from toolkit.errors import ConfigError
from toolkit.launch.argv import LAUNCHERS, build_trial_argv
from toolkit.launch.hosts import Host, place_trial
from toolkit.launch.procs import cpu_slots

__all__ = ["CONFIG_READS_ENV", "CPU_ALLOCATOR_ENV", "CPU_MEMORY_FRACTION", "CPU_MEMORY_RESERVE",
           "RunnerSettings", "WINDOW_STEPS_FACTOR", "available_memory_bytes", "default_memory_per_slot"]

#: The user's DeepSpeed config files (``os.pathsep``-joined) whose reads in a trial's processes open
#: the trial's own config instead (toolkit/dsat/trial/site/sitecustomize.py reads it).
CONFIG_READS_ENV = "TOOLKIT_DSAT_CONFIG_READS"

#: The CPU default of ``--memory-per-slot``: this fraction of the memory available when dsat
#: starts, less this reserve for the system, the autotuner and the launchers, shared by the slots.
CPU_MEMORY_FRACTION = 0.8
CPU_MEMORY_RESERVE = 2 * 2**30

#: A trial filling ``--timed-window`` times at most this many times the profile steps more: a
#: bound on its length (and on the steps the training loop must provide), whatever the window.
WINDOW_STEPS_FACTOR = 4

#: Set (unless already set) for the trials and the full run under a CPU budget. glibc's malloc
#: serves a block below its mmap threshold from its heap, which keeps freed blocks resident, and
#: raises that threshold (up to 32 MiB) each time a mapped block is freed; so the peak resident
#: size of a step jumps where its tensors cross 32 MiB and is not monotonic in the micro-batch
#: (measured: an MLP's peak at micro-batch 30000 was twice its peak at 40000). Fixed at glibc's
#: initial 128 KiB, the peak grows linearly and the memory model's predictions hold; set it in
#: your own launches of the tuned config for the same memory.
CPU_ALLOCATOR_ENV = (("MALLOC_MMAP_THRESHOLD_", str(128 * 1024)),)


def default_memory_per_slot(available_bytes: int, *, slots: int) -> int:
    """The CPU budget per slot without ``--memory-per-slot``: ``(0.8 x available - 2 GiB) / slots``, at
    least 1 byte (the memory model then says nothing fits). Pure; any process.

    >>> default_memory_per_slot(12 * 2**30, slots=2) // 2**20   # (9.6 GiB - 2 GiB) / 2
    3891
    """
    room = int(available_bytes * CPU_MEMORY_FRACTION) - CPU_MEMORY_RESERVE
    return max(room // max(int(slots), 1), 1)


def available_memory_bytes() -> int:
    """Memory available to new processes now (``MemAvailable`` of /proc/meminfo; elsewhere the
    physical memory). Autotuner process only."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """How trials are launched and limited; dsat's flags name most fields. Checked on construction.

    ``entrypoint`` (``("python3", "train.py")``) runs in ``model_dir``; ``slots_per_trial`` processes
    per trial, ``max_slots`` over all trials, ``max_concurrent`` trials at once. ``memory_per_slot``:
    the CPU budget in bytes per rank, held against its peak RSS (None: none).
    ``start_profile_step`` to ``end_profile_step``: the timed ``steps_completed`` values (FLOPs are
    counted on the step before: start >= 1); ``timed_window_s``: the least time they span, more steps
    timed up to :attr:`last_profile_step`. ``gpus``: indices as ``torch.cuda`` numbers them (into an
    inherited ``CUDA_VISIBLE_DEVICES``), None on CPU. ``hosts`` None: this machine alone; else each
    trial is placed on them and started through ``multihost_launcher`` unless all its hosts are this
    machine. ``merge_config``: merge the tuned keys over the script's config (False: only check it);
    ``config_files``: the user's config files whose reads in a trial open the trial's config;
    ``hf_batch_flags``: HF Trainer's batch flags carry each trial's micro-batch and accumulation.
    Each field: docs/design-dsat-runner.md#settings."""

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
    timed_window_s: float = 3.0
    gpus: tuple[int, ...] | None = None
    grace_s: float = 5.0
    poll_s: float = 0.25
    hosts: tuple[Host, ...] | None = None
    multihost_launcher: str = "pdsh"
    ssh_port: int | None = None
    experiment_config: Path | None = None
    echo: bool = True
    heartbeat_s: float = 20.0
    merge_config: bool = True
    config_files: tuple[Path, ...] = ()
    hf_batch_flags: bool = False

    def __post_init__(self) -> None:
        # Normalise containers (lists from argparse/YAML) before the checks; frozen, hence object.__setattr__.
        if isinstance(self.entrypoint, (list, tuple)):
            object.__setattr__(self, "entrypoint", tuple(self.entrypoint))
        object.__setattr__(self, "config_files", tuple(Path(p) for p in self.config_files))
        if isinstance(self.model_dir, (str, os.PathLike)):
            object.__setattr__(self, "model_dir", Path(self.model_dir))
        if isinstance(self.gpus, list):
            object.__setattr__(self, "gpus", tuple(self.gpus))
        if isinstance(self.hosts, list):
            object.__setattr__(self, "hosts", tuple(self.hosts))
        problems = [*self._value_problems(), *self._slot_problems(), *self._host_problems()]
        if not problems:  # the entrypoint must be launchable: say so now, not at the first trial
            try:
                build_trial_argv(list(self.entrypoint), launcher=self.launcher, nproc=self.slots_per_trial,
                                 master_port=29500)
            except ConfigError as err:
                problems.extend(err.problems)
        if problems:
            raise ConfigError(problems)

    def _value_problems(self) -> list[str]:
        """Each setting on its own: one sentence per bad value, naming dsat's flag or the config key."""
        p: list[str | None] = []
        ep = self.entrypoint
        if not isinstance(ep, tuple) or not ep or not all(isinstance(x, str) and x for x in ep):
            p.append(f"entrypoint={ep!r}: expected a non-empty list of strings, e.g. ('python3', 'train.py')")
        if not isinstance(self.model_dir, Path) or not self.model_dir.is_dir():
            p.append(f"model_dir={str(self.model_dir)!r}: expected an existing directory (the entrypoint's)")
        p += [int_problem(name, getattr(self, field), minimum=1) for field, name in (
            ("slots_per_trial", "resources.slots_per_trial"), ("max_slots", "--max-slots"),
            ("max_concurrent", "--max-concurrent-trials"))]
        for field, name in (("timeout_s", "--trial-timeout"), ("grace_s", "grace_s"), ("poll_s", "poll_s"),
                            ("heartbeat_s", "heartbeat_s")):
            value = getattr(self, field)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                p.append(f"{name}={value!r}: expected a number of seconds > 0")
        if self.launcher not in LAUNCHERS:
            p.append(f"--launcher={self.launcher!r}: expected one of {', '.join(LAUNCHERS)}")
        if self.memory_per_slot is not None:
            p.append(int_problem("--memory-per-slot", self.memory_per_slot, minimum=1,
                                 hint=" (bytes), or None"))
        if not is_number(self.timed_window_s) or not math.isfinite(self.timed_window_s) \
                or self.timed_window_s < 0:
            p.append(f"--timed-window={self.timed_window_s!r}: expected a number of seconds >= 0")
        s, e = self.start_profile_step, self.end_profile_step
        p += [int_problem("--start-profile-step", s, minimum=1, hint=" (step start-1 counts the FLOPs)"),
              int_problem("--end-profile-step", e, minimum=1)]
        if is_int(s) and is_int(e) and 1 <= s and 1 <= e < s:
            p.append(f"--end-profile-step={e} < --start-profile-step={s}: expected end >= start")
        if self.multihost_launcher not in MULTIHOST_LAUNCHERS:
            p.append(f"--multihost-launcher={self.multihost_launcher!r}: expected one of "
                     f"{', '.join(MULTIHOST_LAUNCHERS)}")
        if self.ssh_port is not None:
            p.append(int_problem("--ssh-port", self.ssh_port, minimum=1, maximum=65535, hint=", or None"))
        return [problem for problem in p if problem]

    @property
    def last_profile_step(self) -> int:
        """The last step a trial may time to fill :attr:`timed_window_s`: ``end_profile_step``
        plus :data:`WINDOW_STEPS_FACTOR` times the profile steps (``end_profile_step`` without a
        window). The trial's loop should run one step more."""
        if self.timed_window_s <= 0:
            return self.end_profile_step
        profiled = self.end_profile_step - self.start_profile_step + 1
        return self.end_profile_step + WINDOW_STEPS_FACTOR * profiled

    def trial_contract(self, trial_id: int, *, result_path: Path, profile: bool,
                       ds_config: Path | None = None) -> TrialContract:
        """What a trial under these settings is told (its ``trial.json``); ``ds_config``: the
        trial's own DeepSpeed config file, which its engine is held to. Pure; any process."""
        return TrialContract(trial_id=trial_id, result_path=str(result_path), profile=profile,
                             start_profile_step=self.start_profile_step,
                             end_profile_step=self.end_profile_step, memory_per_slot=self.memory_per_slot,
                             timed_window_s=float(self.timed_window_s),
                             last_profile_step=self.last_profile_step,
                             ds_config=None if ds_config is None else str(ds_config),
                             merge_config=bool(self.merge_config))

    def _slot_problems(self) -> list[str]:
        """The GPU ids, and the slot counts against each other, the GPUs given or this machine's cores."""
        spt, most, g = self.slots_per_trial, self.max_slots, self.gpus
        p = []
        gpus_ok = g is None or (isinstance(g, tuple) and all(is_int(x) and x >= 0 for x in g)
                                and len(set(g)) == len(g))
        if not gpus_ok:
            p.append(f"gpus={g!r}: expected distinct GPU ids >= 0, or None on CPU")
        if not (is_int(spt) and is_int(most) and spt >= 1 and most >= 1):
            return p  # the counts are reported as values already
        if most < spt:
            p.append(f"resources.slots_per_trial={spt} > --max-slots={most}: no trial could ever start; "
                     "lower resources.slots_per_trial or raise --max-slots")
        elif gpus_ok and g is not None and most > len(g) and self.hosts is None:
            p.append(f"--max-slots={most} but only {len(g)} GPU(s) given ({g}); lower --max-slots or give "
                     "more GPUs")
        if g is None and self.hosts is None and spt > cpu_slots():
            p.append(f"resources.slots_per_trial={spt}: a trial on CPU runs one process per slot and this "
                     f"machine has {cpu_slots()} CPU core(s); expected at most {cpu_slots()} (or give more "
                     "machines with --hostfile)")
        return p

    def _host_problems(self) -> list[str]:
        """The hosts, and whether a trial fits on them."""
        if self.hosts is None or self.multihost_launcher not in MULTIHOST_LAUNCHERS:
            return []
        hosts = self.hosts
        if not isinstance(hosts, tuple) or not hosts or not all(isinstance(h, Host) for h in hosts) \
                or len({h.name for h in hosts}) != len(hosts):
            return [f"hosts={hosts!r}: expected distinct Host entries (toolkit.launch.hosts), "
                    "or None"]
        total = sum(h.slots for h in hosts)
        if is_int(self.max_slots) and self.max_slots > total:
            return [f"--max-slots={self.max_slots} but the hosts have {total} slot(s) in all; lower "
                    "--max-slots"]
        if is_int(self.slots_per_trial) and place_trial(
                {h.name: tuple(range(h.slots)) for h in hosts}, self.slots_per_trial,
                uniform=self.multihost_launcher == "srun") is None:
            slots = {h.name: h.slots for h in hosts}
            srun = (" with the same number of slots on each host (srun)"
                    if self.multihost_launcher == "srun" else "")
            return [f"resources.slots_per_trial={self.slots_per_trial} cannot be placed on the hosts "
                    f"{slots}{srun}"]
        return []
