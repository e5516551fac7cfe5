"""An sshd on a loopback port for pdsh, and the mpirun line that works as root (issue 16). Test-only.

Root's ``~/.ssh`` and ``/etc/ssh`` are left alone: ssh takes ``~`` from the passwd entry and
ignores ``$HOME``, so the client is steered by a wrapper ``WORKDIR/bin/ssh`` (``exec ssh -F
WORKDIR/ssh_config "$@"``) first on PATH (:meth:`Sshd.env`); pdsh and DeepSpeed's runner run
``ssh`` from PATH, so they reach this sshd as ``localhost`` or ``127.0.0.1``::

    sshd = start_sshd(tmp_path / "sshd")
    subprocess.run(["pdsh", "-w", "localhost", "hostname"], env=sshd.env(), check=True)
    sshd.stop()
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hostprocs import (
    OWNER_ENV,
    SBIN_PATH,
    ClusterError,
    daemon_env,
    free_port,
    owner_mark,
    pids_of,
    tail,
    terminate,
    which,
)


@dataclass
class Sshd:
    workdir: Path
    port: int
    key: Path          # the client's private key, authorized for root
    ssh_config: Path   # the client's config: port, key, no host-key prompts
    bin_dir: Path      # holds the `ssh` wrapper
    proc: subprocess.Popen | None = None
    version: str = ""

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (os.environ) where plain ``ssh``, ``pdsh -R ssh`` and DeepSpeed's pdsh runner reach
        this sshd."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '')}:{SBIN_PATH}"
        env["PDSH_RCMD_TYPE"] = "ssh"
        return env

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc.pid, 5.0, self.proc)
        # per-connection children of sshd (a client still connected keeps one alive)
        for pid in pids_of("sshd", str(self.workdir / "sshd_config")):
            terminate(pid, 2.0)
        self.proc = None


def _configs(wd: Path, port: int, host_key: Path, key: Path) -> tuple[Path, Path]:
    """(sshd_config, client ssh_config)."""
    auth = wd / "authorized_keys"
    auth.write_text(Path(f"{key}.pub").read_text())
    os.chmod(auth, 0o600)
    server = wd / "sshd_config"
    server.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {wd}/sshd.pid",
        f"AuthorizedKeysFile {auth}", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "PermitUserEnvironment no", "PrintMotd no", "UseDNS no", "LogLevel ERROR", "MaxStartups 100:30:200",
        "MaxSessions 100", ""]))
    host = socket.gethostname()
    client = wd / "ssh_config"
    client.write_text("\n    ".join([
        f"Host 127.0.0.1 localhost {host.split('.')[0]} {host}", "HostName 127.0.0.1", f"Port {port}",
        "User root", f"IdentityFile {key}", "IdentitiesOnly yes"]) + "\n" + "\n    ".join([
        "Host *", "BatchMode yes", "StrictHostKeyChecking no", f"UserKnownHostsFile {wd}/known_hosts",
        "GlobalKnownHostsFile /dev/null", "LogLevel ERROR", "ConnectTimeout 10"]) + "\n")
    return server, client


def start_sshd(workdir: str | os.PathLike[str], timeout: float = 15) -> Sshd:
    """sshd on a free 127.0.0.1 port with its own host key; root logs in with a fresh ed25519 key."""
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    os.chmod(wd, 0o700)
    sshd, keygen, ssh = which("sshd"), which("ssh-keygen"), which("ssh")
    if not (sshd and keygen and ssh):
        raise ClusterError("sshd, ssh or ssh-keygen is not installed "
                           "(hostprocs.ensure_packages installs them)")
    for pid in pids_of("sshd", str(wd / "sshd_config")):
        terminate(pid, 3.0)
    host_key, key = wd / "ssh_host_ed25519_key", wd / "id_ed25519"
    for k in (host_key, key):
        if not k.exists():
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "toolkit-tests", "-f", str(k)],
                           check=True, capture_output=True, timeout=30)
    port = free_port()
    server, client = _configs(wd, port, host_key, key)
    bin_dir = wd / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec {ssh} -F {client} \"$@\"\n")
    (bin_dir / "ssh").chmod(0o755)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir; systemd makes it normally
    check = subprocess.run([sshd, "-t", "-f", str(server)], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise ClusterError(f"sshd -t: {check.stderr.strip()}")
    log = wd / "sshd.log"
    # sshd overwrites its environment with its process title, so the owner mark goes into its argv
    # (which the title keeps); SetEnv also marks what its sessions start
    mark = ["-o", f"SetEnv={OWNER_ENV}={owner_mark()}"]
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(server), "-E", str(log), *mark], env=daemon_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    daemon = Sshd(wd, port, key, client, bin_dir, proc)
    try:
        _wait_login(daemon, log, timeout)
        version = subprocess.run([ssh, "-V"], capture_output=True, text=True, timeout=30)
        daemon.version = version.stderr.strip()
    except BaseException:
        daemon.stop()
        raise
    return daemon


def _wait_login(daemon: Sshd, log: Path, timeout: float) -> None:
    """Until ``ssh localhost true`` through the wrapper succeeds."""
    deadline = time.monotonic() + timeout
    while True:
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise ClusterError(f"sshd exited {daemon.proc.returncode}: {tail(log)}")
        r = subprocess.run(["ssh", "localhost", "true"], env=daemon.env(), capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"ssh to the test sshd failed: {r.stderr.strip()} {tail(log)}")
        time.sleep(0.1)


def mpirun_argv(np: int, *cmd: str) -> list[str]:
    """``mpirun`` as root on a 2-core machine with loopback only (Open MPI 4.1; findings.md section 4).

    ``--allow-run-as-root``: Open MPI refuses root otherwise. The ``lo`` options keep its
    out-of-band and byte-transfer layers on loopback (otherwise it advertises every interface).
    """
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
            "--mca", "btl", "self,vader", "--mca", "btl_vader_single_copy_mechanism", "none",
            "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo", *cmd]
