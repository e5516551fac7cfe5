"""Packages and processes for the real-cluster tests (issue 16): apt installs, daemon environments,
process lookups, and DeepSpeed's op-build lock. Standard library only; test-only.

* :func:`ensure_packages` installs what is missing (root and apt-get only) and otherwise returns
  the reason the tests skip.
* :func:`daemon_env`: a daemon must not carry ``TOOLKIT_TEST_SESSION`` (tests/conftest.py kills
  every process that does after each module), but carries ``REALCLUSTER_OWNER`` (this pytest's pid
  and start time), so that :func:`reap_orphans` finds the daemons of a pytest that was killed
  before its teardown ran.
* :func:`clear_stale_op_locks`: a rank killed while torch's JIT loader held
  ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` leaves it, and every later DeepSpeed process waits on it
  forever; removed only when no compiler runs and the lock is old.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OWNER_ENV = "REALCLUSTER_OWNER"

# executable -> the Debian package that ships it (slurm's three are pulled by slurm-wlm)
REQUIRED_BINARIES: dict[str, str] = {
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "srun": "slurm-wlm", "sbatch": "slurm-wlm",
    "salloc": "slurm-wlm", "scancel": "slurm-wlm", "sinfo": "slurm-wlm", "squeue": "slurm-wlm",
    "scontrol": "slurm-wlm", "munged": "munge", "mungekey": "munge", "mpirun": "openmpi-bin",
    "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh",
}
# pdsh's ssh module is a separate .so of the pdsh package
PDSH_SSH_MODULE_GLOB = "usr/lib/*/pdsh/sshcmd.so"
# Variables a daemon must not inherit from the pytest process (see the module docstring).
_DAEMON_ENV_DROP = ("TOOLKIT_", "SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "OMPI_", "PMIX_", "PMI_")
_BUILD_TOOLS = {"ninja", "cc1plus", "c++", "g++", "gcc", "cc", "ld", "as", "nvcc"}


class ClusterError(RuntimeError):
    """A daemon did not start or answer; the message has the tail of its log."""


def which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + SBIN_PATH)


def missing_packages() -> list[str]:
    pkgs = sorted({pkg for exe, pkg in REQUIRED_BINARIES.items() if which(exe) is None})
    if "pdsh" not in pkgs and not list(Path("/").glob(PDSH_SSH_MODULE_GLOB)):
        pkgs.append("pdsh")
    return pkgs


def ensure_packages(timeout: float = 1200) -> str | None:
    """Install what is missing with apt-get: None on success, else the reason to skip.

    Nothing to do costs a few ``shutil.which`` calls. The install uses --no-install-recommends
    and a temporary /usr/sbin/policy-rc.d (exit 101), so that the packages' scripts start no
    munged, sshd or slurmd on the system's ports. A lock file serialises concurrent sessions.
    """
    if not missing_packages():
        return None
    if os.name != "posix" or os.geteuid() != 0:
        return f"{', '.join(missing_packages())} not installed, and installing them needs root"
    apt = which("apt-get")
    if apt is None:
        return f"{', '.join(missing_packages())} not installed, and there is no apt-get to install them"
    with open(Path(tempfile.gettempdir()) / "toolkit-ensure-packages.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pkgs = missing_packages()  # another session may have installed them meanwhile
        if pkgs:
            failure = _apt_install(apt, pkgs, timeout)
            if failure:
                return failure
    still = missing_packages()
    return f"still missing after apt-get install: {still}" if still else None


def _apt_install(apt: str, pkgs: list[str], timeout: float) -> str | None:
    """apt-get install (once more after apt-get update if it fails); None or the failure."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive",
               PATH=os.environ.get("PATH", "") + ":" + SBIN_PATH)
    cmd = [apt, "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confdef",
           "-o", "Dpkg::Options::=--force-confold", "-o", "DPkg::Lock::Timeout=300", "install", *pkgs]
    policy = Path("/usr/sbin/policy-rc.d")
    created = False
    deadline = time.monotonic() + timeout
    try:
        if not policy.exists():
            policy.write_text("#!/bin/sh\n# temporary, written by toolkit's tests\nexit 101\n")
            policy.chmod(0o755)
            created = True
        out = ""
        for attempt in range(2):
            if attempt:
                subprocess.run([apt, "-q", "update"], env=env, capture_output=True,
                               timeout=max(30, deadline - time.monotonic()))
            r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=max(30, deadline - time.monotonic()))
            out = (r.stdout + r.stderr).strip()
            if r.returncode == 0:
                return None
        return f"apt-get install {' '.join(pkgs)} failed: {out[-800:]}"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"apt-get install {' '.join(pkgs)} failed: {err!r}"
    finally:
        if created:
            with contextlib.suppress(OSError):
                policy.unlink()


def free_port(exclude: set[int] | None = None) -> int:
    """A TCP port free on 127.0.0.1 right now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not exclude or port not in exclude:
            return port
    raise ClusterError("no free port on 127.0.0.1")


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_mark(pid: int | None = None) -> str:
    """``<pid>:<start time>`` of this process: unique while it lives, even across pid reuse."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid)}"


def daemon_env(**extra: str) -> dict[str, str]:
    """This environment without the test-session mark and launcher variables, plus the owner mark."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DAEMON_ENV_DROP)}
    env["PATH"] = env.get("PATH", "") + ":" + SBIN_PATH
    env[OWNER_ENV] = owner_mark()
    env.update(extra)
    return env


def pid_alive(pid: int) -> bool:
    """True for a live process that is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def terminate(pid: int, grace: float = 5.0, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM, ``grace`` seconds, then SIGKILL; reaps ``proc`` when it is our child."""
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None if proc else pid_alive(pid)):
            time.sleep(0.05)
        if proc.poll() is None if proc else pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def pids_of(exe: str, token: str) -> list[int]:
    """Processes running ``exe`` (or Debian's ``exe-wlm``) whose argv contains ``token`` (a workdir path)."""
    found = []
    for pid in _pids():
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            names = {os.path.basename(os.readlink(f"/proc/{pid}/exe")), os.path.basename(argv[0].decode())}
            if names & {exe, exe + "-wlm"} and any(token.encode() in a for a in argv):
                found.append(pid)
    return found


def unix_socket_owners(prefix: str) -> list[int]:
    """Processes holding a unix socket whose path starts with ``prefix`` (slurmstepd of a spool dir)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(prefix):
                inodes.add(f"socket:[{parts[6]}]")
    owners = []
    for pid in _pids() if inodes else []:
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                owners.append(pid)
    return [pid for pid in owners if pid != os.getpid()]


def owner_of(pid: int) -> str | None:
    """The owner mark in a process's environment, or in its argv (sshd overwrites its environment)."""
    token = OWNER_ENV.encode() + b"="
    for name in ("environ", "cmdline"):
        with contextlib.suppress(OSError):
            for item in Path(f"/proc/{pid}/{name}").read_bytes().replace(b" ", b"\0").split(b"\0"):
                start = item.find(token)
                if start >= 0:
                    return item[start + len(token):].decode(errors="replace")
    return None


def reap_orphans() -> list[int]:
    """Kill daemons whose owner (a pytest process) is gone: the watchdog's ``os._exit`` skips teardown."""
    killed = []
    for pid in _pids():
        mark = owner_of(pid)
        if mark is None or not mark.partition(":")[0].isdigit():
            continue
        owner = int(mark.partition(":")[0])
        if not (pid_alive(owner) and owner_mark(owner) == mark):
            terminate(pid, 2.0)
            killed.append(pid)
    return killed


def _build_running() -> bool:
    for pid in _pids():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() in _BUILD_TOOLS:
                return True
    return False


def clear_stale_op_locks(extensions_dir: str | os.PathLike[str] | None = None, *,
                         min_age_s: float = 10.0) -> list[Path]:
    """Remove ``<TORCH_EXTENSIONS_DIR>/*/lock`` files left by killed ranks; returns those removed.

    torch's loader creates the lock, runs ninja (a no-op when the op is built, as setup.sh built
    them) and removes it; a rank killed in between leaves it, and every later load waits on it
    forever. A lock is stale when it is ``min_age_s`` old and no compiler or ninja runs; a younger
    one is waited for (at most ``min_age_s``) and judged again.
    """
    root = Path(extensions_dir or os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    removed: list[Path] = []
    for lock in list(root.glob("*/lock")) if str(root) else []:
        with contextlib.suppress(OSError):
            age = time.time() - lock.stat().st_mtime
            if age < min_age_s:
                time.sleep(min_age_s - age)
            if lock.exists() and not _build_running():
                lock.unlink()
                removed.append(lock)
    return removed


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
