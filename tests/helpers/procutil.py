"""Launch real processes for tests: torchrun, the deepspeed launcher, plain python. Test-only."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "workers"
#: Marks every process this test run starts (conftest.py kills those still alive after a module).
#: Unique per pytest process, so that two test runs on one machine leave each other alone.
SESSION_ENV = "TOOLKIT_TEST_SESSION"
SESSION_ID = f"{os.getpid()}-{os.urandom(4).hex()}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment without launcher variables that would confuse a child, plus extras."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "TOOLKIT_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    env[SESSION_ENV] = SESSION_ID
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def clean_launch_env(monkeypatch) -> None:
    """This process's environment as dsat trials should inherit it: no launcher variables, one
    OpenMP thread, toolkit importable (a pytest fixture's body; undone by ``monkeypatch``)."""
    for key in list(os.environ):
        if key.startswith(("TOOLKIT_", "OMPI_", "PMI_", "SLURM_")) or key in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_SIZE", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def torchrun_argv(script: str | Path, *args: str, nproc: int = 2, port: int | None = None,
                  extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port or free_port()), *(extra or []),
            str(script), *args]


def deepspeed_argv(script: str | Path, *args: str, nproc: int = 2, port: int | None = None) -> list[str]:
    """The ``deepspeed`` launcher on one machine (no ssh/pdsh).

    On CPU DeepSpeed counts its "devices" from LOCAL_SIZE (else NUMA nodes): run it with
    ``child_env(LOCAL_SIZE=str(nproc))``.
    """
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
            "--master_port", str(port or free_port()), str(script), *args]


def run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 300,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run to completion with a timeout; on timeout the whole session is killed."""
    proc = subprocess.Popen(argv, env=env or child_env(), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        import signal
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"{argv} timed out after {timeout} s; output:\n{out[-4000:]}") from timed_out
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}; output:\n{result.stdout[-6000:]}"
    return result.stdout


def install_sim_model(model: Path, model_dir: Path) -> None:
    """Put a simulated dsat model into ``model_dir`` as ``model.py``, with the result helper
    (tests/workers/dsat_sim_result.py) it imports from its own directory."""
    shutil.copy(model, model_dir / "model.py")
    shutil.copy(WORKERS / "dsat_sim_result.py", model_dir / "dsat_sim_result.py")
