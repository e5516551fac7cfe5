"""Probe: a dsat trial started by a fork of a process that imported torch and DeepSpeed once,
against the same trial started by torchrun (issue 29 item 5). Not used by dsat.

Run it from the repository root (about 2 minutes on a 2-core machine; docs/benchmarks.md, "A
preloaded fork per trial (probe)", has the figures)::

    .venv/bin/python scripts/bench_preload.py
    .venv/bin/python scripts/bench_preload.py --pairs 4 --micro-batch 64

Real trials of ``examples/core_api/train.py`` on 2 ranks, made small as in scripts/bench_trial.py
(ZeRO stage 1, dsat's default profile steps 3-5 and 3 s timed window), started by dsat's own
:class:`~toolkit.dsat.execution.runner.TrialRunner` as profiling trials (so that each reports its
start-up and step peaks), in two interleaved arms after one warm-up trial of each:

* **torchrun**: as dsat starts every local trial now;
* **fork**: the runner's ``subprocess.Popen`` of a torchrun argv is replaced, in this process only,
  by a request to a server (this file with ``--serve``) started once with the first trial's
  environment less its trial marks. The server imports torch, DeepSpeed and torch._dynamo, then per
  request forks a launcher (own session, the trial's log files on its stdout and stderr, its
  working directory), which forks one process per rank; each rank takes the trial's environment
  and torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and
  runs the script with :mod:`runpy` as ``__main__``; the launcher exits 1 when a rank fails, as
  torchrun does. The runner sees the launcher's exit status through the server.

What this probe does not do, and dsat would have to before it forks trials: the forked ranks do
not carry the trial's mark in ``/proc/PID/environ`` (that shows the server's environment), so the
runner holds them to the memory budget and finds them only as the launcher's descendants; a
``LD_PRELOAD``, ``MALLOC_*`` or ``OMP_NUM_THREADS`` that differs between trials would need a
server of its own (they are read when a process starts); GPUs are left out (the server must not
initialise CUDA before it forks). And a forked rank's peak resident size is lower than a fresh
process's (it never touches the pages the imports touched), which the memory model would have
to correct for: the table shows by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRIAL_MARKS = ("TOOLKIT_DSAT_TRIAL", "TOOLKIT_TRIAL_HPARAMS", "TOOLKIT_OUTPUT_DIR")


# ------------------------------------------------------------------------------ the server (--serve)
def serve() -> int:
    """The server's loop: requests (JSON lines) on stdin, answers on the original stdout."""
    import ctypes
    import runpy
    import select
    import threading
    import traceback

    proto = os.dup(1)  # what the imports print goes to stderr, not into the answers
    os.dup2(2, 1)
    started = time.monotonic()
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    get_accelerator()
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def send(message: dict[str, Any]) -> None:
        os.write(proto, (json.dumps(message) + "\n").encode())

    def launcher(req: dict[str, Any]) -> tuple[str, Any]:
        os.close(proto)
        os.setsid()
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(req["cwd"])
        ranks: dict[int, int] = {}
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                return "rank", (req, rank)
            ranks[pid] = rank

        def forward(signum: int, _frame: Any) -> None:
            for pid in ranks:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        signal.signal(signal.SIGTERM, forward)
        failed = False
        while ranks:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            ranks.pop(pid, None)
            if os.waitstatus_to_exitcode(status) != 0 and not failed:
                failed = True
                forward(signal.SIGTERM, None)
        return "exit", 1 if failed else 0

    def rank_main(req: dict[str, Any], rank: int) -> tuple[str, Any]:
        die_with_parent()
        n = req["nproc"]
        env = dict(req["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank),
                   ROLE_WORLD_SIZE=str(n), ROLE_NAME="default", MASTER_ADDR=req["master_addr"],
                   MASTER_PORT=str(req["master_port"]), TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                   TORCHELASTIC_USE_AGENT_STORE="False")
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [req["target"], *req["args"]]
        try:
            if req["mode"] == "module":
                runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(req["target"]))
                runpy.run_path(req["target"], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - the rank's own error, printed as Python would
            traceback.print_exc()
            code = 1
        return "exit", code

    def loop() -> tuple[str, Any]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        send({"ready_s": round(time.monotonic() - started, 2), "threads": threading.active_count()})
        pending = b""
        while True:
            if select.select([0], [], [], 0.01)[0]:
                data = os.read(0, 65536)
                if not data:
                    return "exit", 0
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    req = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        return "launcher", req
                    send({"started": req["id"], "pid": pid})
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    task = loop()
    while task[0] != "exit":
        task = launcher(task[1]) if task[0] == "launcher" else rank_main(*task[1])
    return int(task[1])


# ------------------------------------------------------------------------------ the runner's side
class Server:
    """The server process and its answers, read without blocking."""

    def __init__(self, env: dict[str, str], cwd: str, log: Path) -> None:
        import fcntl

        base = {k: v for k, v in env.items() if k not in TRIAL_MARKS}
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=base, cwd=cwd)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        out = self.proc.stdout.fileno()
        fcntl.fcntl(out, fcntl.F_SETFL, fcntl.fcntl(out, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.buffer, self.answers, self.codes, self.next_id = b"", [], {}, 0
        self.ready = self.expect(lambda m: "ready_s" in m, timeout=120)

    def pump(self) -> None:
        try:
            self.buffer += os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
        except BlockingIOError:
            pass
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.codes[message["exit"]] = message["code"]
            else:
                self.answers.append(message)

    def expect(self, wanted: Any, *, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.pump()
            for message in self.answers:
                if wanted(message):
                    self.answers.remove(message)
                    return message
            if self.proc.poll() is not None:
                raise RuntimeError(f"the preload server exited with status {self.proc.returncode}")
            time.sleep(0.005)
        raise TimeoutError(f"the preload server did not answer within {timeout:g} s")

    def start(self, request: dict[str, Any]) -> int:
        self.next_id += 1
        request = dict(request, id=self.next_id)
        self.proc.stdin.write((json.dumps(request) + "\n").encode())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self.expect(lambda m: m.get("started") == request["id"], timeout=30)["pid"])

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """What the runner needs of a Popen, for a launcher the server forked."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump()
            self.returncode = self.server.codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("forked launcher", timeout or 0)
            time.sleep(0.005)
        return int(self.returncode)  # type: ignore[arg-type]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def patch_runner(state: dict[str, Any], log: Path) -> None:
    """The runner's Popen of a torchrun argv goes to the server while ``state["arm"] == "fork"``."""
    from toolkit.dsat.execution import runner as runner_module

    def popen(argv: list[str], *, cwd: Any, env: dict[str, str], stdin: Any, stdout: Any, stderr: Any,
              start_new_session: bool) -> Any:
        if state["arm"] != "fork" or "torch.distributed.run" not in argv:
            return subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                    start_new_session=start_new_session)
        rest = argv[argv.index("--master_port") + 2:]
        mode = "module" if rest[0] == "--module" else "script"
        rest = rest[1:] if mode == "module" else rest
        if "server" not in state:
            state["server"] = Server(env, str(cwd), log)
        pid = state["server"].start({
            "env": env, "cwd": str(cwd), "stdout": stdout.name, "stderr": stderr.name,
            "nproc": int(argv[argv.index("--nproc_per_node") + 1]),
            "master_addr": argv[argv.index("--master_addr") + 1],
            "master_port": int(argv[argv.index("--master_port") + 1]), "mode": mode,
            "target": rest[0], "args": rest[1:]})
        return Forked(state["server"], pid)

    fake = types.SimpleNamespace(**{k: getattr(subprocess, k) for k in dir(subprocess)
                                    if not k.startswith("__")})
    fake.Popen = popen
    runner_module.subprocess = fake  # type: ignore[assignment]


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    import bench_trial

    from toolkit.dsat.tuner_cli import build_parser, make_plan
    from toolkit.dsat.execution.runner import TrialRunner

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    experiment = bench_trial.write_experiment(argparse.Namespace(deterministic=False), work)
    plan = make_plan(build_parser().parse_args(
        ["binary", str(experiment), str(bench_trial.EXAMPLE), "--memory-per-slot", "1GiB", "--max-slots", "2",
         "--output-dir", str(work / "dsat")]))
    state: dict[str, Any] = {"arm": "torchrun"}
    patch_runner(state, work / "server.log")
    rows = []
    with TrialRunner(plan.runner, output_dir=work / "dsat") as runner:
        for trial_id, arm in enumerate(["torchrun", "fork"] + ["torchrun", "fork"] * args.pairs, 1):
            state["arm"] = arm
            spec, config = bench_trial.stage1_trial(plan, trial_id, args.micro_batch, profile=True)
            started = time.monotonic()
            runner.start(spec, ds_config=config, hparams=plan.hparams)
            done: list[Any] = []
            while not done:
                done = runner.wait(timeout=1.0)
            result, profile = done[0], done[0].profile or {}
            row = {"trial": trial_id, "arm": arm if trial_id > 2 else f"{arm} (warm-up)",
                   "status": result.status.value, "wall_s": round(time.monotonic() - started, 2),
                   "latency_ms": result.metrics.get("latency"),
                   "startup_peak_mib": round(profile.get("startup_peak_bytes", 0) / 2**20, 1),
                   "step_peak_mib": round(profile.get("peak_bytes", 0) / 2**20, 1), "error": result.error}
            rows.append(row)
            print(json.dumps(row), flush=True)
    server = state.get("server")
    if server is not None:
        server.close()
    return {"rows": rows, "server_ready": server.ready if server else None,
            "yardstick_s": bench_trial.yardstick()}


def report(summary: dict[str, Any]) -> str:
    counted = [r for r in summary["rows"] if "warm-up" not in r["arm"]]

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in counted if r["arm"] == arm and r[key] is not None)

    lines = ["| | torchrun | fork |", "|---|---:|---:|"]
    for key, name in (("wall_s", "trial wall time (s)"), ("latency_ms", "step latency (ms)"),
                      ("startup_peak_mib", "start-up peak (MiB, VmHWM)"),
                      ("step_peak_mib", "steps' peak (MiB)")):
        lines.append(f"| {name}, median | {median('torchrun', key):.4g} | {median('fork', key):.4g} |")
    ratio = median("fork", "wall_s") / median("torchrun", "wall_s")
    statuses = sorted({r["status"] for r in summary["rows"]})
    lines.append(f"\nfork / torchrun wall time (medians): {ratio:.2f}")
    lines.append(f"server: {summary['server_ready']} (its imports, once); statuses: {statuses}; "
                 f"yardstick {summary['yardstick_s']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if (argv if argv is not None else sys.argv[1:])[:1] == ["--serve"]:
        return serve()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="torchrun/fork pairs after the warm-ups (default 3)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_preload")
    p.add_argument("--output", type=Path, default=None, help="JSON of every trial")
    args = p.parse_args(argv)
    summary = run(args)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=2))
    print(report(summary))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.path.pop(0)  # this file's directory: each rank puts its own script's there
    sys.exit(main())
