"""Hosts and slots across machines: DeepSpeed's hostfile, a Slurm allocation, and where a trial goes
(:func:`place_trial`). For the runners' slot pool; pure, the runner's process. The rules:
docs/design-dsat-runner.md#slots; how dsat uses them: docs/multi-node.md. Example::

    >>> hosts = parse_hostfile("localhost slots=2\\n127.0.0.1 slots=2\\n")
    >>> place_trial({h.name: tuple(range(h.slots)) for h in hosts}, 3)
    {'localhost': (0, 1), '127.0.0.1': (0,)}
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from typing import Mapping, Sequence

from toolkit._checks import is_int
from toolkit.bounded_load import read_text
from toolkit.errors import ConfigError
from toolkit.runtime.launch_env import parse_slurm_counts, parse_slurm_nodelist

__all__ = ["Host", "parse_hostfile", "read_hostfile", "expand_slurm_nodelist", "expand_slurm_counts",
           "slurm_hosts", "is_local_host", "local_names", "place_trial", "format_include"]

_HOST_RE = re.compile(r"^(\S+)\s+slots\s*=\s*(\S+)\s*$")


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine (``name`` as ssh, pdsh and srun reach it) and the trial processes (``slots``) it takes."""

    name: str
    slots: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ConfigError(f"host name {self.name!r}: expected a non-empty name without spaces")
        if not is_int(self.slots) or self.slots < 1:
            raise ConfigError(f"host {self.name!r}: slots={self.slots!r}, expected an integer >= 1")


def parse_hostfile(text: str, *, source: str = "hostfile") -> tuple[Host, ...]:
    """Hosts of a DeepSpeed hostfile's text (``name slots=N`` per line, ``#`` comments). ConfigError naming
    ``source`` and the line: malformed, slots < 1, a host twice, or no host. Any process."""
    hosts: list[Host] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_RE.match(line)
        if not match:
            problems.append(f"{source}, line {number}: {raw.strip()!r} is not 'HOSTNAME slots=N' "
                            "(e.g. 'worker-0 slots=8')")
            continue
        name, slots = match.group(1), match.group(2)
        if not slots.isdigit() or int(slots) < 1:
            problems.append(f"{source}, line {number}: slots={slots!r} for {name!r}; expected an integer "
                            ">= 1")
            continue
        if name in seen:
            problems.append(f"{source}, line {number}: host {name!r} is already given on line {seen[name]}; "
                            "give each host once")
            continue
        seen[name] = number
        hosts.append(Host(name, int(slots)))
    if not hosts and not problems:
        problems.append(f"{source}: no host; expected lines like 'worker-0 slots=8'")
    if problems:
        raise ConfigError(problems)
    return tuple(hosts)


def read_hostfile(path: str | os.PathLike[str]) -> tuple[Host, ...]:
    """Read and parse a hostfile (:func:`parse_hostfile`); ConfigError: unreadable or malformed."""
    try:
        text = read_text(path, what="hostfile")
    except (OSError, ValueError) as err:  # the loader's ConfigError: over its size, not UTF-8
        raise ConfigError(f"hostfile {os.fspath(path)!r} cannot be read: {err}") from None
    return parse_hostfile(text, source=f"hostfile {os.fspath(path)}")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm node list, in order, zero padding kept, without ``scontrol``: ``node[01-03,7]``
    -> ``node01 node02 node03 node7``; ConfigError when empty or malformed. Any process."""
    hosts = parse_slurm_nodelist(nodelist)
    if hosts is None:
        raise ConfigError(f"SLURM node list {nodelist!r} cannot be parsed; expected e.g. "
                          "'node[01-03,7],login1'")
    return hosts


def expand_slurm_counts(text: str) -> list[int]:
    """Slurm's per-node counts: ``'2(x3),1'`` -> ``[2, 2, 2, 1]``; ConfigError when malformed. Any process."""
    counts = parse_slurm_counts(text)
    if counts is None:
        raise ConfigError(f"Slurm count list {text!r} cannot be parsed; expected e.g. '2(x3),1'")
    return counts


def _gpus_per_node(text: str) -> int | None:
    """``SLURM_GPUS_PER_NODE``: ``'4'`` or ``'a100:4'`` -> 4."""
    match = re.fullmatch(r"\s*(?:[^:,]+:)?(\d+)\s*", text)
    return int(match.group(1)) if match else None


def slurm_hosts(environ: Mapping[str, str] | None = None) -> tuple[Host, ...] | None:
    """The hosts of the current Slurm allocation, or None outside one; slots per node from
    ``SLURM_GPUS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``, else ``SLURM_JOB_CPUS_PER_NODE``.
    ConfigError: those variables malformed or disagreeing. Any process."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand_slurm_nodelist(nodelist)
    gpus = env.get("SLURM_GPUS_PER_NODE")
    if gpus:
        per_node = _gpus_per_node(gpus)
        if per_node is None:
            raise ConfigError(f"SLURM_GPUS_PER_NODE={gpus!r} cannot be parsed; expected e.g. '4' or 'a100:4'")
        counts, variable = [per_node] * len(names), "SLURM_GPUS_PER_NODE"
    else:
        found = next((v for v in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE") if env.get(v)), None)
        if found is None:
            raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is set but none of SLURM_GPUS_PER_NODE, "
                              "SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE is; pass --hostfile instead")
        counts, variable = expand_slurm_counts(env[found]), found
    if len(counts) != len(names):
        raise ConfigError(f"{variable}={env.get(variable)!r} gives {len(counts)} count(s) but "
                          f"SLURM_JOB_NODELIST={nodelist!r} names {len(names)} node(s)")
    return tuple(Host(name, count) for name, count in zip(names, counts, strict=True) if count > 0)


def local_names() -> frozenset[str]:
    """Names of this machine: ``localhost``, its host name and fully qualified name. Any process."""
    names = {"localhost", "localhost.localdomain", "ip6-localhost"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names |= {name, name.split(".")[0]}
    return frozenset(names)


def is_local_host(name: str, *, names: frozenset[str] | None = None) -> bool:
    """True when ``name`` is this machine (a loopback address or one of ``names``), which is launched
    without ssh; loopback aliases in one hostfile are one machine (handy to test placement). Pure."""
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    return name in (local_names() if names is None else names)


def place_trial(free: Mapping[str, Sequence[int]], slots: int, *, uniform: bool = False
                ) -> dict[str, tuple[int, ...]] | None:
    """The slots of one trial, host -> slot ids, from ``free`` (each host's free ids, in hostfile order), or
    None when it does not fit now: one host when one has room (the fewest free slots that suffice),
    else as few hosts as possible, the roomiest first; ``uniform``: the same count on each (srun). Pure."""
    order = list(free)
    fits = [h for h in order if len(free[h]) >= slots]
    if fits:
        host = min(fits, key=lambda h: (len(free[h]), order.index(h)))
        return {host: tuple(sorted(free[host])[:slots])}
    by_room = sorted((h for h in order if free[h]), key=lambda h: (-len(free[h]), order.index(h)))
    if uniform:
        for count in range(2, len(by_room) + 1):  # fewest hosts first
            if slots % count == 0 and len(free[by_room[count - 1]]) >= slots // count:
                chosen = sorted(by_room[:count], key=order.index)
                return {h: tuple(sorted(free[h])[:slots // count]) for h in chosen}
        return None
    placement: dict[str, tuple[int, ...]] = {}
    needed = slots
    for host in by_room:
        take = min(needed, len(free[host]))
        placement[host] = tuple(sorted(free[host])[:take])
        needed -= take
        if needed == 0:
            return {h: placement[h] for h in order if h in placement}
    return None


def format_include(placement: Mapping[str, Sequence[int]]) -> str:
    """DeepSpeed's ``--include``: ``{'a': (0, 1), 'b': (0,)}`` -> ``'a:0,1@b:0'``. Pure."""
    return "@".join(f"{host}:{','.join(str(i) for i in ids)}" for host, ids in placement.items())
