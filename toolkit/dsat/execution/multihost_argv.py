"""The argv that launches one dsat trial across hosts: pure logic, no processes.

A trial whose slots are on a host that is not this machine (see
:mod:`toolkit.launch.hosts`) is started by :func:`build_multihost_argv`; a trial on this
machine by :func:`toolkit.launch.argv.build_trial_argv`, whose rules for the entrypoint (a
leading interpreter dropped, a launcher it names stripped, Determined's wrappers unwrapped)
apply here too. Only :mod:`toolkit.dsat.execution.runner` spawns a trial.

Decisions (documented here because tests compare argv lists exactly):

* ``pdsh``, ``openmpi``, ``mvapich``, ``mpich``, ``impi``: DeepSpeed's own multinode runner,
  ``python -m deepspeed.launcher.runner --hostfile TRIAL_HOSTFILE`` with the trial's hosts only,
  ``--master_addr`` its first host, ``--master_port`` its own port, ``--force_multi`` (a single
  remote host would otherwise be started on this machine) and ``--no_local_rank``; under pdsh also
  ``--include host:ids@host:ids`` (the slot ids, hence the GPUs, of each host; DeepSpeed's MPI
  runners refuse ``--include`` and run one process per listed slot). ``ssh_port`` becomes
  ``--ssh_port``.
* ``pdsh`` runs that runner through :mod:`toolkit.dsat.execution.pdsh_launch` (the same options):
  DeepSpeed's own pdsh command joins the arguments, the exported variables and ``cd MODEL_DIR``
  unquoted into the one line the remote shell runs, so ``;``, ``$(...)`` or a space in them was
  shell syntax there. :func:`pdsh_remote_command` quotes every word of that line instead, and
  doubles ``%`` (pdsh replaces ``%h``, ``%u``, ``%n`` and ``%%`` inside quotes too): the script
  receives its arguments exactly as a local launch does. The remote login shell must be a
  POSIX shell (sh, bash, dash, zsh).
* ``srun`` (inside a Slurm allocation): ``srun --nodes N --ntasks T --ntasks-per-node K
  --nodelist H1,H2 --exact --kill-on-bad-exit=1`` and the rendezvous address in ``--export``;
  ranks read the Slurm variables (:mod:`toolkit.runtime.launch_env`). srun places tasks by count, so a
  trial must have the same number of slots on each host (``place_trial(uniform=True)``).

Example::

    >>> build_multihost_argv(["python3", "train.py"], placement={"w0": [0], "w1": [0]}, via="srun",
    ...                      master_port=29511)[:3]
    ['srun', '--nodes=2', '--ntasks=2']
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Mapping, Sequence

from toolkit._checks import is_int
from toolkit.launch.argv import DEEPSPEED_MODE_FLAGS, parse_entrypoint

__all__ = ["MULTIHOST_LAUNCHERS", "PDSH_RUNNER_MODULE", "build_multihost_argv", "build_remote_kill_argv",
           "config_flag", "pdsh_remote_command", "with_config_flag"]

#: Launchers of a trial across hosts: DeepSpeed's multinode runners, or ``srun``.
MULTIHOST_LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "srun")
#: DeepSpeed's multinode runner with a quoted pdsh command (``python -m``; same options).
PDSH_RUNNER_MODULE = "toolkit.dsat.execution.pdsh_launch"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_placement(placement: Mapping[str, Sequence[int]]) -> None:
    if not isinstance(placement, Mapping) or not placement:
        raise ValueError(f"placement={placement!r}: expected a non-empty mapping host -> slot ids")
    for host, ids in placement.items():
        if not isinstance(host, str) or not host or any(c.isspace() or c in ",@:" for c in host):
            raise ValueError(f"placement host {host!r}: expected a host name without spaces, ',', '@' or ':'")
        if isinstance(ids, str) or not ids or not all(is_int(i) and i >= 0 for i in ids) \
                or len(set(ids)) != len(ids):
            raise ValueError(f"placement {host!r}: {ids!r}, expected distinct slot ids >= 0")


def build_multihost_argv(entrypoint: Sequence[str], *, placement: Mapping[str, Sequence[int]], via: str,
                         master_port: int, hostfile: str | os.PathLike[str] | None = None,
                         ssh_port: int | None = None, gpus: bool = False) -> list[str]:
    """The argv that starts ``entrypoint`` on the hosts of ``placement``. Pure; any process.

    Args:
        entrypoint: as for :func:`toolkit.launch.argv.build_trial_argv`.
        placement: host -> slot ids, in rank order (from :func:`toolkit.launch.hosts.place_trial`).
        via: one of :data:`MULTIHOST_LAUNCHERS`.
        master_port: the trial's own rendezvous port on the first host.
        hostfile: DeepSpeed runners only: a hostfile listing exactly the placement's hosts with
            their slot counts (the runner writes one per trial).
        ssh_port: DeepSpeed runners only: ssh port of the hosts (``--ssh_port``).
        gpus: ``srun`` only: ask for the slots as GPUs (``--gpus-per-node``).

    Returns:
        A new argv list; never run through a shell.

    Raises:
        ConfigError: the entrypoint cannot be launched.
        ValueError: a bad ``via``, ``placement``, ``master_port``, ``hostfile`` or ``ssh_port``;
            under srun, unequal slot counts per host.

    Example::

        argv = build_multihost_argv(["python3", "train.py"], placement={"w0": [0, 1], "w1": [0, 1]},
                                    via="pdsh", master_port=29512, hostfile="trial_7/hostfile")
    """
    if via not in MULTIHOST_LAUNCHERS:
        raise ValueError(f"via={via!r}: expected one of {', '.join(MULTIHOST_LAUNCHERS)}")
    _check_placement(placement)
    if not is_int(master_port) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port={master_port!r}: expected an integer port in 1..65535")
    if ssh_port is not None and (not is_int(ssh_port) or not 1 <= ssh_port <= 65535):
        raise ValueError(f"ssh_port={ssh_port!r}: expected an integer port in 1..65535, or None")
    mode, target, args = parse_entrypoint(entrypoint)
    if via == "srun":
        return _srun_argv(placement, master_port=master_port, gpus=gpus) + _srun_command(mode, target) + args
    if hostfile is None or not os.fspath(hostfile):
        raise ValueError(f"via={via!r} needs the trial's hostfile (hostfile=None given)")
    argv = _deepspeed_runner_argv(placement, via=via, master_port=master_port, hostfile=hostfile,
                                  ssh_port=ssh_port)
    argv += DEEPSPEED_MODE_FLAGS[mode]
    return argv + [target] + args


def _srun_argv(placement: Mapping[str, Sequence[int]], *, master_port: int, gpus: bool) -> list[str]:
    """srun's own options for a trial: one step over the placement's hosts, the same tasks on each."""
    counts = {len(ids) for ids in placement.values()}
    if len(counts) != 1:
        raise ValueError(f"placement={dict(placement)!r}: srun starts the same number of tasks on every "
                         "host; place the trial with place_trial(uniform=True)")
    per_host, hosts = counts.pop(), list(placement)
    argv = ["srun", f"--nodes={len(hosts)}", f"--ntasks={per_host * len(hosts)}",
            f"--ntasks-per-node={per_host}", f"--nodelist={','.join(hosts)}", "--exact",
            "--kill-on-bad-exit=1", f"--export=ALL,MASTER_ADDR={hosts[0]},MASTER_PORT={master_port}"]
    if gpus:
        argv.append(f"--gpus-per-node={per_host}")
    return argv


def _srun_command(mode: str, target: str) -> list[str]:
    """What srun starts on each task: this interpreter on the script or module, or the program."""
    return {"module": [sys.executable, "-u", "-m", target], "exec": [target],
            "script": [sys.executable, "-u", target]}[mode]


def _deepspeed_runner_argv(placement: Mapping[str, Sequence[int]], *, via: str, master_port: int,
                           hostfile: str | os.PathLike[str], ssh_port: int | None) -> list[str]:
    """DeepSpeed's multinode runner with the trial's hostfile, rendezvous and launcher (no script yet)."""
    from toolkit.launch.hosts import format_include  # pure, no cycle at import time

    module = PDSH_RUNNER_MODULE if via == "pdsh" else "deepspeed.launcher.runner"
    argv = [sys.executable, "-m", module, "--hostfile", os.fspath(hostfile)]
    if via == "pdsh":  # DeepSpeed's MPI runners refuse --include: their hostfile is the trial's alone
        argv += ["--include", format_include(placement)]
    argv += ["--master_addr", next(iter(placement)), "--master_port", str(master_port), "--launcher", via,
             "--force_multi", "--no_local_rank"]
    if ssh_port is not None:
        argv += ["--ssh_port", str(ssh_port)]
    return argv


def _pdsh_word(word: str) -> str:
    """One word for the remote shell of a pdsh command: shell-quoted, ``%`` doubled for pdsh."""
    return shlex.quote(word).replace("%", "%%")


def pdsh_remote_command(launcher: Sequence[str], script: Sequence[str], *, cwd: str,
                        exports: Mapping[str, str] | None = None, source: str | None = None) -> str:
    """The line pdsh has each host's shell run for one trial, every word quoted. Pure; any process.

    ``[. SOURCE &&] cd -- CWD && export K=V && ... exec LAUNCHER... --node_rank=%n SCRIPT...``:
    each word (path, value, argument) is quoted for a POSIX shell with :func:`shlex.quote` and
    its ``%`` doubled, because pdsh replaces ``%n``, ``%h``, ``%u`` and ``%%`` anywhere in the
    line; only ``--node_rank=%n`` (the host's rank, which DeepSpeed's launcher takes) is pdsh's.

    Args:
        launcher: DeepSpeed's per-node launcher and its options, e.g. ``[python, "-u", "-m",
            "deepspeed.launcher.launch", "--world_info=...", ...]``.
        script: the user's script (or module, or program) and its arguments.
        cwd: the directory the launcher runs in on each host.
        exports: variables set for the launcher; names must be shell identifiers.
        source: a script sourced first (DeepSpeed's ``--venv_script``), or None.

    Raises:
        ValueError: an empty ``launcher`` or ``script``, or an export name that is not an identifier.
    """
    if isinstance(launcher, str) or isinstance(script, str) or not launcher or not script:
        raise ValueError(f"launcher={launcher!r}, script={script!r}: expected non-empty lists of words")
    bad = [key for key in (exports or {}) if not _ENV_NAME.fullmatch(key)]
    if bad:
        raise ValueError(f"exported variable name(s) {bad!r}: expected shell identifiers "
                         "([A-Za-z_][A-Za-z0-9_]*)")
    steps = [] if source is None else [f". {_pdsh_word(source)}"]
    steps.append(f"cd -- {_pdsh_word(cwd)}")
    steps += [f"export {key}={_pdsh_word(value)}" for key, value in (exports or {}).items()]
    words = [_pdsh_word(w) for w in launcher] + ["--node_rank=%n"] + [_pdsh_word(w) for w in script]
    return " && ".join(steps + ["exec " + " ".join(words)])


def build_remote_kill_argv(hosts: Sequence[str], *, master_port: int,
                           ssh_port: int | None = None) -> list[str]:
    """pdsh argv that stops one trial's DeepSpeed launchers on its hosts. Pure; any process.

    DeepSpeed's runner, on SIGTERM, runs ``pkill -f`` on *every* ``deepspeed.launcher.launch``
    of the hosts, other trials' too; this one matches only the launcher with the trial's own
    ``--master_port`` (``[d]`` keeps the pattern from matching the remote shell running it).
    ``deepspeed.launcher.launch`` stops its ranks on SIGTERM.
    """
    if isinstance(hosts, str) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ValueError(f"hosts={hosts!r}: expected a non-empty list of host names")
    if not is_int(master_port) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port={master_port!r}: expected an integer port in 1..65535")
    pattern = f"'[d]eepspeed.launcher.launch.*--master_port={master_port}( |$)'"
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), "pkill", "-TERM", "-f", pattern]


def _config_flags(entrypoint: Sequence[str]) -> list[tuple[int, str, str]]:
    """(index of the path, flag, path) of each DeepSpeed config flag: ``--deepspeed_config PATH``,
    ``--deepspeed_config=PATH``, HF Trainer's ``--deepspeed PATH`` / ``--deepspeed=PATH`` (a value
    naming a ``.json``, DeepSpeed's autotuner's rule: alone, ``--deepspeed`` is DeepSpeed's switch)."""
    found = []
    words = list(entrypoint)
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag not in ("--deepspeed_config", "--deepspeed"):
            continue
        if not eq:
            if i + 1 >= len(words) or words[i + 1].startswith("-"):
                continue
            value, i = words[i + 1], i + 1
        if flag == "--deepspeed_config" or ".json" in value:
            found.append((i, flag, value))
    return found


def config_flag(entrypoint: Sequence[str]) -> tuple[str, str] | None:
    """The entrypoint's first DeepSpeed config flag and the path it names, or None. Pure.

    >>> config_flag(["python3", "train.py", "--deepspeed", "--deepspeed_config", "ds.json"])
    ('--deepspeed_config', 'ds.json')
    >>> config_flag(["python3", "train.py", "--deepspeed=ds_config.json"])
    ('--deepspeed', 'ds_config.json')
    """
    found = _config_flags(entrypoint)
    return (found[0][1], found[0][2]) if found else None


def with_config_flag(entrypoint: Sequence[str], path: str | os.PathLike[str]) -> list[str]:
    """``entrypoint`` with every DeepSpeed config flag (:func:`config_flag`) naming ``path``; a new
    list, the rest unchanged. dsat's trials only (``python -m toolkit.run`` keeps the user's argv). Pure.

    >>> with_config_flag(["python3", "train.py", "--deepspeed_config=ds.json", "--lr", "1"], "/t/ds.json")
    ['python3', 'train.py', '--deepspeed_config=/t/ds.json', '--lr', '1']
    """
    words = list(entrypoint)
    for i, flag, _old in _config_flags(words):
        words[i] = f"{flag}={os.fspath(path)}" if words[i].startswith(flag + "=") else os.fspath(path)
    return words
