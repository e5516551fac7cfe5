"""A one-host Slurm cluster for the tests (issue 16): munged, slurmctld and slurmd on loopback.

Adapted from the research recipe (/work/notes/r16/cluster.py, findings.md). Everything lives
under one work directory; nothing in /etc is changed; the daemons run as root (SlurmUser=root)
without the test-session mark (see :mod:`hostprocs`)::

    cluster = start_slurm(tmp_path / "slurm")
    cluster.run("srun", "--ntasks", "2", "hostname")
    cluster.stop()

Things the real programs taught (findings.md):

* ``proctrack/linuxproc`` and ``task/none``: the cgroup plugins fail in this VM (no freezer).
* ``SlurmctldHost`` must name this host (``gethostname()``), with ``(127.0.0.1)`` as its address.
* slurmctld checks time limits and ``--signal=SIG@N`` warnings only every 30 s (PERIODIC_TIMEOUT,
  a compile-time constant) counted from its start: :meth:`SlurmCluster.next_timelimit_check`.
* ``sbatch --wait`` polls with growing sleeps (10 s for ``true``); :meth:`SlurmCluster.wait_job`
  polls every 50 ms.
* More tasks than CPUs pend forever: give every srun/salloc a bound (``--immediate``) or fit 2 CPUs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hostprocs import (
    SBIN_PATH,
    ClusterError,
    daemon_env,
    free_port,
    pids_of,
    tail,
    terminate,
    unix_socket_owners,
    which,
)

_ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
           "SIGNALING", "STAGE_OUT")


@dataclass
class Munge:
    workdir: Path
    socket_path: Path
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc.pid, 5.0, self.proc)
        self.proc = None


def start_munge(workdir: Path, timeout: float = 15) -> Munge:
    """munged with its own key, socket, pid, log and seed files under ``workdir/munge``."""
    wd = workdir / "munge"
    wd.mkdir(parents=True, exist_ok=True)
    os.chmod(wd, 0o700)
    for pid in pids_of("munged", str(wd) + "/"):  # left by an earlier session on this workdir
        terminate(pid, 3.0)
    key, sock = wd / "munge.key", wd / "munge.socket"
    if not key.exists():
        subprocess.run([which("mungekey") or "mungekey", "--create", "--keyfile", str(key), "--bits", "1024",
                        "--force"], check=True, capture_output=True, timeout=30)
    os.chmod(key, 0o600)
    for stale in (sock, Path(f"{sock}.lock"), wd / "munged.pid"):
        stale.unlink(missing_ok=True)
    cmd = [which("munged") or "munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
           f"--pid-file={wd / 'munged.pid'}", f"--log-file={wd / 'munged.log'}",
           f"--seed-file={wd / 'munged.seed'}", "--num-threads=2"]
    with open(wd / "munged.out", "ab") as log:
        proc = subprocess.Popen(cmd, env=daemon_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    munge = Munge(wd, sock, proc)
    probe = f"munge -n -S {shlex.quote(str(sock))} | unmunge -S {shlex.quote(str(sock))}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"munged exited {proc.returncode}: {tail(wd / 'munged.log')}")
        if sock.exists() and subprocess.run(probe, shell=True, capture_output=True,
                                            timeout=15).returncode == 0:
            return munge
        time.sleep(0.05)
    munge.stop()
    raise ClusterError(f"munged did not come up in {timeout} s: {tail(wd / 'munged.log')}")


@dataclass
class SlurmCluster:
    workdir: Path
    conf: Path
    nodename: str
    cpus: int
    munge: Munge
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ctld_started: float = 0.0  # time.time() when slurmctld was started
    version: str = ""

    PERIODIC_TIMEOUT = 30  # slurmctld's time-limit / --signal check interval (compile-time constant)

    def next_timelimit_check(self, after: float | None = None) -> float:
        """time.time() of slurmctld's next time-limit and ``--signal`` check after ``after`` (now)."""
        after = time.time() if after is None else after
        ticks = int((after - self.ctld_started) // self.PERIODIC_TIMEOUT) + 1
        return self.ctld_started + ticks * self.PERIODIC_TIMEOUT

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (os.environ) for client commands: SLURM_CONF set, any outer job's variables dropped."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":" + SBIN_PATH
        return env

    def run(self, *args: str, check: bool = True, timeout: float = 60, env: dict[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess:
        """A client command (cwd: the workdir, where sbatch without -o writes its output)."""
        return subprocess.run(list(args), env=env or self.env(), cwd=cwd or self.workdir, capture_output=True,
                              text=True, check=check, timeout=timeout, stdin=subprocess.DEVNULL)

    def node_state(self) -> str:
        r = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=15)
        return r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr.strip()}"

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    log = self.workdir / "log" / f"{name}.log"
                    raise ClusterError(f"{name} exited {p.returncode}: {tail(log)}")
            state = self.node_state()
            if state == "idle":
                return
            time.sleep(0.2)
        raise ClusterError(f"node not idle after {timeout} s (state {state!r}); slurmd log:\n"
                           f"{tail(self.workdir / 'log' / 'slurmd.log')}")

    def job_state(self, jobid: str) -> str:
        r = self.run("scontrol", "-o", "show", "job", str(jobid), check=False, timeout=15)
        match = re.search(r"JobState=(\S+)", r.stdout)
        return match.group(1) if match else "UNKNOWN"  # UNKNOWN: purged already

    def wait_job(self, jobid: str, timeout: float = 120) -> str:
        """Wait until the job left the active states; its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(jobid)
            if state not in _ACTIVE:
                return state
            time.sleep(0.05)
        raise ClusterError(f"job {jobid} still {self.job_state(jobid)} after {timeout} s")

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        """``sbatch --parsable ARGS``; the job id."""
        return self.run("sbatch", "--parsable", *args, env=env).stdout.strip().split(";")[0]

    def steps(self) -> list[str]:
        """The job steps running now (``squeue -s``)."""
        r = self.run("squeue", "-h", "-s", "-o", "%i", check=False, timeout=15)
        return r.stdout.split()

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job and wait for the queue to drain."""
        self.run("scancel", "--user=root", check=False, timeout=15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run("squeue", "-h", "-o", "%i", check=False, timeout=15)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel the jobs, then stop slurmd, slurmctld, leftover slurmstepd and munged."""
        with contextlib.suppress(Exception):
            if self.procs and all(p.poll() is None for p in self.procs.values()):
                self.cancel_all(timeout=15)
        for name in ("slurmd", "slurmctld"):
            if name in self.procs:
                terminate(self.procs[name].pid, 10.0, self.procs[name])
        for pid in unix_socket_owners(str(self.workdir / "spool") + "/"):
            terminate(pid, 2.0)
        self.munge.stop()
        self.procs.clear()


def _hardware(slurmd: str) -> tuple[int, int]:
    """(CPUs, RealMemory in MiB) from ``slurmd -C``."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout
    line = next((x for x in out.splitlines() if x.startswith("NodeName=")), "")
    values = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
    return int(values.get("CPUs", os.cpu_count() or 1)), int(values.get("RealMemory", 1024))


def _node_name() -> str:
    """The short host name when it resolves (ranks resolve rank 0's host from the node list), else
    localhost."""
    host = socket.gethostname().split(".")[0]
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        return "localhost"


def _write_conf(wd: Path, *, nodename: str, cpus: int, memory: int, munge: Munge) -> Path:
    conf = wd / "slurm.conf"
    ctld_port = free_port()
    conf.write_text(f"""\
# generated by toolkit's tests (tests/cluster/realcluster.py): one node on loopback
ClusterName=toolkit
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={free_port({ctld_port})}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge.socket_path}
StateSaveLocation={wd}/state
SlurmdSpoolDir={wd}/spool
SlurmctldPidFile={wd}/run/slurmctld.pid
SlurmdPidFile={wd}/run/slurmd.pid
SlurmctldLogFile={wd}/log/slurmctld.log
SlurmdLogFile={wd}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
ReturnToService=2
KillWait=2
MinJobAge=300
InactiveLimit=0
MessageTimeout=10
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
PropagateResourceLimitsExcept=MEMLOCK
NodeName={nodename} NodeAddr=127.0.0.1 NodeHostname={nodename} CPUs={cpus} RealMemory={max(1, memory - 256)} \
State=UNKNOWN
PartitionName=debug Nodes={nodename} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
    return conf


def _spawn(cluster: SlurmCluster, name: str, argv: list[str]) -> subprocess.Popen:
    with open(cluster.workdir / "log" / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(argv, env=daemon_env(SLURM_CONF=str(cluster.conf)), cwd=cluster.workdir,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    cluster.procs[name] = proc
    return proc


def _wait_ctld(cluster: SlurmCluster, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``scontrol ping`` says UP (a bare TCP probe makes the daemons log errors)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log = cluster.workdir / "log" / "slurmctld.log"
            raise ClusterError(f"slurmctld exited {proc.returncode}: {tail(log)}")
        r = cluster.run("scontrol", "ping", check=False, timeout=15)
        if r.returncode == 0 and "UP" in r.stdout:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"slurmctld not answering after {timeout} s: {r.stdout} {r.stderr}")
        time.sleep(0.05)


def start_slurm(workdir: str | os.PathLike[str], timeout: float = 60) -> SlurmCluster:
    """munged, slurmctld and slurmd for one node (this host, its CPUs) with everything under ``workdir``.

    Leftover daemons of the same workdir are killed and its state wiped first, so a second call
    on one workdir is a clean restart. Root only.
    """
    if os.geteuid() != 0:
        raise ClusterError("a Slurm cluster needs root (SlurmUser=root; slurmd runs as root)")
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    slurmctld, slurmd = which("slurmctld"), which("slurmd")
    if not slurmctld or not slurmd:
        raise ClusterError("slurmctld and slurmd are not installed (hostprocs.ensure_packages installs them)")
    for exe in ("slurmctld", "slurmd"):
        for pid in pids_of(exe, str(wd / "slurm.conf")):
            terminate(pid, 5.0)
    for pid in unix_socket_owners(str(wd / "spool") + "/"):
        terminate(pid, 2.0)
    for d in ("state", "spool", "log", "run"):
        shutil.rmtree(wd / d, ignore_errors=True)
        (wd / d).mkdir(parents=True)
    munge = start_munge(wd)
    cluster = None
    try:
        nodename = _node_name()
        cpus, memory = _hardware(slurmd)
        conf = _write_conf(wd, nodename=nodename, cpus=cpus, memory=memory, munge=munge)
        cluster = SlurmCluster(wd, conf, nodename, cpus, munge)
        cluster.version = cluster.run("sinfo", "--version", check=False).stdout.strip()
        cluster.ctld_started = time.time()
        ctld = _spawn(cluster, "slurmctld", [slurmctld, "-D", "-c", "-i", "-f", str(conf)])
        _wait_ctld(cluster, ctld, timeout)
        _spawn(cluster, "slurmd", [slurmd, "-D", "-c", "-f", str(conf), "-N", nodename])
        cluster.wait_idle(timeout)
        return cluster
    except BaseException:
        if cluster is not None:
            cluster.stop()
        munge.stop()
        raise
