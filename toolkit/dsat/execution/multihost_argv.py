"""The argv that launches one dsat trial across hosts (pdsh, the MPI runners, srun): pure, no processes.

A trial on this machine is :func:`toolkit.launch.argv.build_trial_argv`'s, and only
:mod:`toolkit.dsat.execution.runner` spawns. Tests compare these lists exactly; the rules:
docs/design-dsat-runner.md#across-hosts.
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
    """The argv that starts ``entrypoint`` on the hosts of ``placement`` (host -> slot ids in rank
    order, :func:`toolkit.launch.hosts.place_trial`) through ``via``. Pure; any process.

    ``hostfile`` (the trial's hosts alone) and ``ssh_port``: DeepSpeed's runners only; ``gpus``: srun
    only (``--gpus-per-node``). ConfigError: an entrypoint that cannot be launched; ValueError: a bad
    argument (under srun, unequal slot counts per host)."""
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

    ``[. SOURCE &&] cd -- CWD && export K=V && ... exec LAUNCHER... --node_rank=%n SCRIPT...``: each
    word :func:`shlex.quote`-d and its ``%`` doubled (pdsh expands ``%n``, ``%h``, ``%u``, ``%%`` even
    inside quotes); only ``--node_rank=%n`` is pdsh's. ValueError: an empty ``launcher`` or ``script``,
    or an export name that is not a shell identifier."""
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
    """pdsh argv that stops only this trial's DeepSpeed launchers on its hosts (DeepSpeed's runner would
    ``pkill`` every one there, other trials' too); each stops its ranks on SIGTERM. Pure; any process."""
    if isinstance(hosts, str) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ValueError(f"hosts={hosts!r}: expected a non-empty list of host names")
    if not is_int(master_port) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port={master_port!r}: expected an integer port in 1..65535")
    # only the launcher with this trial's port; [d] keeps the pattern from matching the remote shell
    pattern = f"'[d]eepspeed.launcher.launch.*--master_port={master_port}( |$)'"
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), "pkill", "-TERM", "-f", pattern]


def _config_flags(entrypoint: Sequence[str]) -> list[tuple[int, str, str]]:
    """(index of the path, flag, path) of each DeepSpeed config flag: ``--deepspeed_config[=]PATH``, and
    HF Trainer's ``--deepspeed[=]PATH`` when it names a ``.json`` (alone it is DeepSpeed's switch)."""
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
    """``entrypoint`` (a new list) with every DeepSpeed config flag (:func:`config_flag`) naming ``path``.
    dsat's trials only (``python -m toolkit.run`` keeps the user's argv). Pure.

    >>> with_config_flag(["python3", "train.py", "--deepspeed_config=ds.json", "--lr", "1"], "/t/ds.json")
    ['python3', 'train.py', '--deepspeed_config=/t/ds.json', '--lr', '1']
    """
    words = list(entrypoint)
    for i, flag, _old in _config_flags(words):
        words[i] = f"{flag}={os.fspath(path)}" if words[i].startswith(flag + "=") else os.fspath(path)
    return words
