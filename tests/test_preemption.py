"""Preemption: real signals, real processes, every rank stops at the same step.

The multi-rank tests run tests/workers/preempt_loop.py under a launcher (2 gloo ranks): a loop
that sleeps 5 ms per step and calls should_preempt() every step (one launch runs several such
loops, one after the other, where a test checks several). The test sends a real signal with
os.kill to ONE worker's pid (not to the launcher, which would forward it to every worker: the
DataLoader-workers test sends that one to torchrun) at a random step, then checks that both ranks
stopped at the same step, within the documented bound, and went on.

The in-process tests use world size 1, where the watcher does no collective and reads only the
context's world size; they build that context by hand instead of initialising torch.distributed
inside the pytest process.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from helpers import procutil
from toolkit.errors import ConfigError
from toolkit.preemption import DEFAULT_SIGNALS, PreemptionWatcher, watch_preemption
from toolkit.runtime.context import DistributedContext

WORKER = procutil.WORKERS / "preempt_loop.py"
STEP_S = 0.005


def _world_of_one() -> DistributedContext:
    return DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                              num_nodes=1, device=torch.device("cpu"), backend="gloo", launcher="none")


def _wait_for_signal(watcher: PreemptionWatcher, timeout: float = 5.0) -> None:
    # os.kill to our own pid is delivered before it returns, but Python runs the handler in the main
    # thread at its next check; poll so a signal taken by another thread first cannot flake the test.
    deadline = time.monotonic() + timeout
    while watcher.received_signal is None and time.monotonic() < deadline:
        time.sleep(0.001)


# ---------------------------------------------------------------- world size 1, in this process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_world_of_one_real_signal_stops_at_the_next_call(sig):
    with watch_preemption(_world_of_one()) as watcher:
        assert [watcher.should_preempt() for _ in range(5)] == [False] * 5
        os.kill(os.getpid(), sig)  # SIGINT included: the handler records it, no KeyboardInterrupt
        _wait_for_signal(watcher)
        assert watcher.received_signal == sig and not watcher.preempted
        assert watcher.should_preempt() is True
        assert watcher.should_preempt() is True and watcher.preempted  # sticky
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal is recorded nowhere, changes nothing
        time.sleep(0.01)
        assert watcher.received_signal == sig


def test_handlers_are_installed_then_restored_including_after_an_exception():
    calls = []

    def mine(signum, frame):
        calls.append(signum)

    original = signal.signal(signal.SIGUSR1, mine)
    try:
        before = {sig: signal.getsignal(sig) for sig in DEFAULT_SIGNALS}
        with watch_preemption(_world_of_one()) as watcher:
            for sig in DEFAULT_SIGNALS:
                assert signal.getsignal(sig) == watcher._on_signal
        assert {sig: signal.getsignal(sig) for sig in DEFAULT_SIGNALS} == before

        with pytest.raises(ZeroDivisionError):
            with watch_preemption(_world_of_one(), signals=[signal.SIGUSR1]):
                _ = 1 / 0
        assert signal.getsignal(signal.SIGUSR1) is mine
        os.kill(os.getpid(), signal.SIGUSR1)  # the restored handler really is the one called
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.001)
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_nested_watchers_restore_in_order_and_close_is_idempotent():
    before = signal.getsignal(signal.SIGTERM)
    outer = watch_preemption(_world_of_one(), signals=[signal.SIGTERM])
    inner = watch_preemption(_world_of_one(), signals=[signal.SIGTERM])
    assert signal.getsignal(signal.SIGTERM) == inner._on_signal
    inner.close()
    assert signal.getsignal(signal.SIGTERM) == outer._on_signal
    inner.close()
    outer.close()
    assert signal.getsignal(signal.SIGTERM) == before
    # After close: the last agreed answer, no error, no collective.
    assert outer.should_preempt() is False


def test_a_handler_replaced_after_the_watcher_stays_when_it_closes():
    """A library (or a watcher closed out of order) that set its handler after ours keeps it."""
    before, before_usr2 = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)

    def theirs(signum, frame):
        pass

    try:
        watcher = watch_preemption(_world_of_one(), signals=[signal.SIGUSR1, signal.SIGUSR2])
        signal.signal(signal.SIGUSR1, theirs)
        watcher.close()
        assert signal.getsignal(signal.SIGUSR1) is theirs
        assert signal.getsignal(signal.SIGUSR2) == before_usr2   # the one left alone is restored
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_request_stop_is_agreed_like_a_signal():
    with watch_preemption(_world_of_one()) as watcher:
        assert watcher.should_preempt() is False
        watcher.request_stop()
        assert watcher.should_preempt() is True and watcher.received_signal is None


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(check_every=0), ConfigError, "check_every=0"),
    (dict(check_every=True), ConfigError, "check_every=True"),
    (dict(check_every=2.5), ConfigError, "check_every=2.5"),
    (dict(check_interval=0), ConfigError, "check_interval=0"),
    (dict(check_interval=float("nan")), ConfigError, "check_interval=nan"),
    (dict(signals=[]), ConfigError, "at least one signal"),
    (dict(signals=[signal.SIGKILL]), ConfigError, "SIGKILL.*cannot catch"),
    (dict(signals=[10_000]), ConfigError, "10000"),
    (dict(signals=signal.SIGTERM), ConfigError, "sequence of signals"),
    # Every problem at once.
    (dict(check_every=0, check_interval=0, signals=[signal.SIGKILL]), ConfigError, "3 problems"),
])
def test_bad_arguments_are_explained_and_install_nothing(kwargs, error, match):
    before = {sig: signal.getsignal(sig) for sig in DEFAULT_SIGNALS}
    with pytest.raises(error, match=match):
        watch_preemption(_world_of_one(), **kwargs)
    assert {sig: signal.getsignal(sig) for sig in DEFAULT_SIGNALS} == before


def test_wrong_context_and_non_main_thread_are_explained():
    with pytest.raises(TypeError, match="DistributedContext"):
        watch_preemption(None)  # type: ignore[arg-type]  # the wrong type on purpose
    # A context of world size 2 made by hand, in a fresh interpreter: an earlier test of this worker
    # may have left a process group.
    code = ("import dataclasses, test_preemption as t\n"
            "two = dataclasses.replace(t._world_of_one(), world_size=2, local_world_size=2)\n"
            "try:\n    t.watch_preemption(two)\nexcept RuntimeError as err:\n    print(err)\n")
    out = procutil.check(procutil.run([sys.executable, "-c", code], cwd=str(procutil.REPO / "tests"),
                                      timeout=120))
    assert "ctx says world size 2 but torch.distributed is not initialised" in out, out
    errors = []

    def body():
        try:
            watch_preemption(_world_of_one())
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=30)
    assert errors and "main thread" in errors[0]


# ---------------------------------------------------------------- real processes


def _read_results(out, n):
    return [json.loads((out / f"result{rank}.json").read_text()) for rank in range(n)]


def _progress(out, rank):
    try:
        return int((out / f"progress{rank}").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _start(argv):
    return subprocess.Popen(argv, env=procutil.child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_progress(proc, out, ranks, step, timeout=240):
    deadline = time.monotonic() + timeout
    while min(_progress(out, rank) for rank in ranks) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate(timeout=30)[0]
            raise AssertionError(f"workers did not reach step {step}; output:\n{output[-4000:]}")
        time.sleep(0.002)


def _finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(
            f"still running after {timeout} s:\n{proc.communicate(timeout=30)[0][-4000:]}") from None
    return proc.returncode, out


# The one-rank signals: (signal, the rank it goes to, check_every).
ONE_RANK = [
    (signal.SIGTERM, 1, 4),       # fixed interval: bound 2 * 4 calls
    (signal.SIGUSR1, 0, None),    # adaptive, check_interval 0.1 s: at most 0.1 / 5 ms = 20 calls apart
    (signal.SIGINT, 1, 1),        # a check point every call: bound 2 calls
]


def _check_one_rank_signal(out, sig, target, check_every, at):
    results = _read_results(out, 2)
    stops = {r["stopped_at"] for r in results}
    assert len(stops) == 1 and None not in stops, (sig.name, at, results)
    stop, seen = results[0]["stopped_at"], results[target]["seen_at"]
    interval = check_every or int(0.1 / STEP_S)  # a step lasts at least STEP_S, so I <= 0.1 / STEP_S
    assert seen is not None and seen >= at and seen <= stop <= seen + 2 * interval - 1, \
        (sig.name, at, results)
    for rank, record in enumerate(results):
        assert record["received"] == (sig.name if rank == target else None), results
        assert record["preempted"] and record["after_close"], results
        assert record["installed"] and record["restored"], results
        assert record["final_steps"] == [stop, stop], results


def test_one_deepspeed_launch_loops_unsignalled_signalled_at_one_rank_rarely_checked_then_terminated(
        tmp_path):
    """Six loops, one after the other in one launch of the deepspeed launcher (2 ranks), each with
    its own watcher; each loop's ranks lived on into the next, so only the last ends the launch:

    0. no signal, 150 calls with check points every 7 calls: the all-reduce launched at call 147
       is still pending when the loop ends; close() must finish it so the all_gather after it
       lines up.
    1-3. a real signal to ONE worker at a random step (ONE_RANK): both ranks stop at the same
       step, within the documented bound of the signalled rank's first sight of it.
    4. rare checks: a loop asking every 20 steps, 2 s apart (0.1 s steps); the last rank is
       signalled after step 25: the pipelined check would answer at step 60, the synchronous one
       at step 40.
    5. SIGTERM to deepspeed.launcher.launch (the per-node launcher), which terminates its workers
       one after the other, waiting up to 30 s for each: rank 1 gets nothing until rank 0 has
       exited. Without an agreement rank 0 would stop alone and rank 1 would hang in a collective.
    """
    import psutil  # a DeepSpeed dependency

    phases = ["--check-every 7 --max-steps 150 --sleep 0.001"]
    phases += [f"--check-every {check_every or 0} --check-interval 0.1 --sleep {STEP_S}"
               for _, _, check_every in ONE_RANK]
    phases.append("--call-every 20 --sleep 0.1 --check-interval 1 --signal-after 25 --max-steps 200")
    phases.append("--check-every 2")
    argv = procutil.deepspeed_argv(WORKER, str(tmp_path), *[a for p in phases for a in ("--phase", p)])
    proc = subprocess.Popen(argv, env=procutil.child_env(LOCAL_SIZE="2"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ats = []
    for i, (sig, target, _) in enumerate(ONE_RANK, start=1):
        ats.append(random.randint(10, 60))
        _wait_progress(proc, tmp_path / f"phase{i}", [0, 1], ats[-1])
        os.kill(int((tmp_path / f"phase{i}" / f"pid{target}").read_text()), sig)
    last = tmp_path / "phase5"
    _wait_progress(proc, last, [0, 1], random.randint(10, 40))
    (launch,) = [child for child in psutil.Process(proc.pid).children()
                 if "deepspeed.launcher.launch" in " ".join(child.cmdline())]
    os.kill(launch.pid, signal.SIGTERM)
    _, output = _finish(proc)  # the launcher exits 1 after forwarding a signal

    for record in _read_results(tmp_path / "phase0", 2):
        assert record["stopped_at"] is None and not record["preempted"] and record["received"] is None
        assert record["final_steps"] == [150, 150] and record["restored"]
    for i, ((sig, target, check_every), at) in enumerate(zip(ONE_RANK, ats, strict=True), start=1):
        _check_one_rank_signal(tmp_path / f"phase{i}", sig, target, check_every, at)
    results = _read_results(tmp_path / "phase4", 2)
    assert [r["stopped_at"] for r in results] == [40, 40], results
    assert results[1]["received"] == "SIGTERM" and results[0]["received"] is None, results

    stops = [json.loads((last / f"stop{rank}.json").read_text()) for rank in range(2)]
    assert stops[0]["stopped_at"] == stops[1]["stopped_at"] and stops[1]["seen_at"] is None, stops
    seen = stops[0]["seen_at"]
    assert seen is not None and seen <= stops[0]["stopped_at"] <= seen + 2 * 2 - 1, stops
    (rank0,) = _read_results(last, 1)  # rank 1 may be terminated after its watcher closed
    assert rank0["received"] == "SIGTERM" and rank0["final_steps"][0] == rank0["final_steps"][1], \
        (rank0, output[-4000:])


def test_sigterm_to_torchrun_with_dataloader_workers_stops_saves_and_resumes(tmp_path):
    # Two loaders in one run, DeepSpeed's training_data= loader and a torch DataLoader, each with
    # num_workers=2, started before watch_preemption; torchrun signals each rank's process group,
    # so the workers get SIGTERM too. They must survive until the ranks stop through should_preempt.
    # Also the SIGTERM forwarded by torchrun: every rank receives it and they stop at the same step.
    # 140 steps: both loaders start a new epoch in the rerun (64 and 128 batches a rank).
    argv = procutil.torchrun_argv(procutil.WORKERS / "preempt_workers.py", str(tmp_path),
                                  "--max-steps", "140")
    proc = _start(argv)
    _wait_progress(proc, tmp_path, [0, 1], 5)
    proc.send_signal(signal.SIGTERM)   # to torchrun itself
    _, output = _finish(proc)
    assert "killed by signal" not in output, output[-4000:]
    stopped = [int((tmp_path / f"stopped{r}").read_text()) for r in (0, 1)]
    assert stopped[0] == stopped[1] and 0 < stopped[0] < 140, output[-4000:]
    left = [json.loads((tmp_path / f"left{r}.json").read_text()) for r in (0, 1)]
    assert left == [{"received": "SIGTERM", "final_steps": stopped}] * 2, left
    assert not list(tmp_path.glob("finished*"))
    out = procutil.check(procutil.run(argv))  # the rerun resumes from the committed checkpoint and finishes
    assert [int((tmp_path / f"resumed{r}").read_text()) for r in (0, 1)] == stopped, out[-4000:]
    assert [int((tmp_path / f"finished{r}").read_text()) for r in (0, 1)] == [140, 140]


def test_after_an_agreed_stop_a_repeated_sigterm_or_sigusr1_does_not_kill_the_rank():
    # Under Slurm the stop reaches a rank twice (Slurm signals every process of the step, the job's
    # launcher passes it on as SIGTERM); the second landed after the save and killed the rank before
    # its exit (tests/cluster/test_slurm_engine.py, 2026-11-27). In a child process: the pytest
    # worker's own SIGTERM must keep its default.
    code = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from test_preemption import _world_of_one, _wait_for_signal
from toolkit.preemption import watch_preemption
with watch_preemption(_world_of_one()) as watcher:   # no stop: the default comes back
    pass
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
with watch_preemption(_world_of_one()) as watcher:
    os.kill(os.getpid(), signal.SIGUSR1)
    _wait_for_signal(watcher)
    assert watcher.should_preempt()
os.kill(os.getpid(), signal.SIGTERM)   # the echo of the stop, after the save
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.05)
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # Ctrl-C still ends it
print("alive")
"""
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], capture_output=True,
                         text=True, timeout=120, env=procutil.child_env())
    assert out.returncode == 0 and out.stdout.strip().endswith("alive"), (out.returncode, out.stderr[-3000:])


# ---------------------------------------------------------------- a launcher stopped alone (issue 41)

RESUME = procutil.WORKERS / "preempt_resume.py"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait(predicate, timeout: float, what: str, proc=None) -> None:
    """Poll ``predicate``; after ``timeout`` s, or once ``proc`` has ended, fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"waited {timeout} s at most for {what}")
        time.sleep(0.02)


def _text(path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def test_the_deepspeed_launcher_killed_alone_its_ranks_save_a_second_run_waits_then_ends_bitwise(tmp_path):
    """Issue 41's case: ``kill <pid of the deepspeed runner>`` (what docker stop sends a container's
    first process) ends the runner alone (-15), which forwards nothing; its ranks, their parent
    deepspeed.launcher.launch alive, must notice it, agree on a step, save and exit. The ranks hold
    their save (``--hold-save``). The very same command meanwhile (same port) waits in
    init_distributed for the first's rank 0, which serves the rendezvous, and exits 2 naming it
    (here after a 2 s wait). The same command on another port (a scheduler that gives each job its
    own) reaches its load and must wait there (its chief names the first's), not load the older
    checkpoint beside them; then it resumes and ends bitwise equal to an uninterrupted (torchrun)
    run. Between the first run's save and its exit (``--hold-exit``) the stop record names the
    committed checkpoint; the second run's lock removes it."""
    from toolkit.checkpoint import layout
    from toolkit.checkpoint.stop_record import read_stop_record

    steps = 24
    reference = tmp_path / "reference"
    procutil.check(procutil.run(procutil.torchrun_argv(RESUME, str(reference), "--steps", str(steps),
                                                       "--sleep", "0"), timeout=400))
    expected = json.loads((reference / "final0.json").read_text())
    out, saving, leaving = tmp_path / "run", tmp_path / "saving", tmp_path / "leaving"
    args = ("--steps", str(steps), "--sleep", "0.1", "--hold-save", str(saving), "--hold-exit", str(leaving))
    argv = procutil.deepspeed_argv(RESUME, str(out), *args)
    env = procutil.child_env(LOCAL_SIZE="2")
    # Output to files: the runner's pipe would stay open (and could fill) while its ranks go on.
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = subprocess.Popen(argv, env=env, stdout=open(logs[0], "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    _wait(lambda: min(_progress(out, r) for r in (0, 1)) >= 3, 300, "3 steps", first)
    ranks = [int(_text(out / f"pid{rank}")) for rank in (0, 1)]
    os.kill(first.pid, signal.SIGTERM)  # the runner alone
    signalled = time.monotonic()
    assert first.wait(timeout=60) == -signal.SIGTERM, _text(logs[0])  # at once, forwarding nothing
    _wait(lambda: all(_text(out / f"agreed{r}") for r in (0, 1)), 60, "both ranks to agree on a stop")
    stop = int(_text(out / "agreed0"))
    assert _text(out / "agreed1") == str(stop) and stop < steps and time.monotonic() - signalled < 60
    assert all(_alive(pid) for pid in ranks)

    # The very same command (same port) with a short wait: the first run's rank 0 still serves the
    # rendezvous; both ranks wait for it in init_distributed, name it, then exit 2, as the launcher does.
    again = procutil.run(argv, env={**env, "TOOLKIT_WAIT_FOR_OTHER_RUN_S": "2"}, timeout=300)
    assert again.returncode == 2, again.stdout[-4000:]
    assert "RunConflictError" in again.stdout and f"pid {ranks[0]}" in again.stdout, again.stdout[-4000:]
    assert _text(out / "loading0") == str(ranks[0]) and all(_alive(pid) for pid in ranks)  # nothing done

    second = subprocess.Popen(procutil.deepspeed_argv(RESUME, str(out), *args), env=env,
                              stdout=open(logs[1], "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: _text(out / "loading0") not in (None, str(ranks[0])), 300, "the second run's load")
        time.sleep(3)  # its chief looks at the lock's holder every second
        assert _text(out / "resumed0") is None and all(_alive(pid) for pid in ranks)  # waiting, not loading
        saving.touch()
        _wait(lambda: all(_text(out / f"stopped{r}") for r in (0, 1)), 60, "the first run's save")
        record = read_stop_record(out / "ckpt")  # written last; the first run still holds the lock
        assert record is not None and record.resumable, record
        assert (record.steps_completed, record.tag) == (stop, f"step_{stop}"), record
        assert record.cause == "a launcher exited", record
        state = layout.scan_dir(out / "ckpt")
        assert state.latest == f"step_{stop}" and [t.tag for t in state.committed()] == [f"step_{stop}"]
        leaving.touch()
        _wait(lambda: not any(_alive(pid) for pid in ranks), 60, "the first run's ranks to exit")
        code = second.wait(timeout=400)
    finally:
        leaving.touch()
        saving.touch()
        for proc in (first, second):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    output = _text(logs[1])
    assert code == 0, output[-4000:]
    assert "is held by another run" in output and f"pid {ranks[0]}" in output, output[-4000:]  # named
    assert [_text(out / f"resumed{r}") for r in (0, 1)] == [str(stop)] * 2
    finals = [json.loads(_text(out / f"final{r}.json")) for r in (0, 1)]
    assert [f["sha256"] for f in finals] == [expected["sha256"]] * 2, (finals, expected)  # bitwise
    # DeepSpeed-Chat's len(train_dataloader): the epoch's, before and after the resumed epoch began
    assert [f["lengths"] for f in finals] == [[30]] * 2 and expected["lengths"] == [30]
    assert read_stop_record(out / "ckpt") is None  # the second run's progress removed it
    state = layout.scan_dir(out / "ckpt")
    assert [t.tag for t in state.committed()] == [f"step_{stop}"] and state.latest == f"step_{stop}"


NOT_A_LAUNCHER = """
import os, subprocess, sys, time
agent, progress, log, *argv = sys.argv[1:]
proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # torchrun, this session
open(agent, "w").write(str(proc.pid))
deadline = time.monotonic() + 240
while not os.path.exists(progress) and time.monotonic() < deadline:
    time.sleep(0.02)
os._exit(0)                             # exits while torchrun runs on: not a stop
"""


def test_torchrun_killed_stops_its_ranks_an_exiting_wrapper_does_not(tmp_path):
    """SIGKILL to torchrun's agent (no signal reaches the ranks): both stop at the same step as if
    signalled and write the stop record (TOOLKIT_STOP_RECORD; no checkpoint, so not resumable).
    Before that, the process that started torchrun, not a launcher, exited while the ranks trained:
    they must go on (the rule: only a launcher's exit is a stop)."""
    from toolkit.checkpoint.stop_record import STOP_RECORD_ENV, read_stop_record

    out, record = tmp_path / "out", tmp_path / "stop.json"
    argv = procutil.torchrun_argv(WORKER, str(out), "--check-interval", "0.1", "--max-steps", "100000")
    log = tmp_path / "torchrun.log"
    wrapper = subprocess.Popen([sys.executable, "-c", NOT_A_LAUNCHER, str(tmp_path / "agent"),
                                str(out / "progress1"), str(log), *argv],
                               env=procutil.child_env(**{STOP_RECORD_ENV: str(record)}),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wrapper.wait(timeout=300) == 0, _text(log)
        agent = int(_text(tmp_path / "agent"))
        _wait(lambda: min(_progress(out, r) for r in (0, 1)) > 0, 60, "progress")
        before = _progress(out, 0)
        time.sleep(1.5)  # three looks at the launchers after the wrapper's exit
        assert _progress(out, 0) > before + 50 and not list(out.glob("stop*.json")), _text(log)  # trains on
        os.kill(agent, signal.SIGKILL)
        _wait(lambda: all((out / f"result{r}.json").exists() for r in (0, 1)), 60, "both ranks to stop")
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError, TypeError):
            os.kill(int(_text(tmp_path / "agent")), signal.SIGKILL)
    results = _read_results(out, 2)
    stops = {r["stopped_at"] for r in results}
    assert len(stops) == 1 and None not in stops, results
    assert all(r["preempted"] and r["received"] is None and r["final_steps"] == [r["stopped_at"]] * 2
               for r in results), results
    stopped = read_stop_record(record)
    assert stopped is not None and stopped.cause == "a launcher exited" and not stopped.resumable, stopped
