"""toolkit.dsat.execution.runner with real processes: torchrun / the deepspeed launcher running
tests/workers/dsat_fake_trial.py (plain Python, so trials start fast).

Every test ends by scanning /proc for any process carrying the trial mark: none may be left.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import procutil
from toolkit.dsat.contract import METRICS, TrialStatus
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
from toolkit.errors import ConfigError
from toolkit.launch.hosts import Host
from toolkit.launch.procs import find_trial_processes

WORKERS = procutil.WORKERS
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Trials inherit this environment: no launcher variables, one OpenMP thread, toolkit importable."""
    procutil.clean_launch_env(monkeypatch)


def make_settings(**kw):
    base = dict(entrypoint=("python3", "dsat_fake_trial.py"), model_dir=WORKERS, slots_per_trial=1,
                max_slots=2, max_concurrent=2, timeout_s=120.0, grace_s=2.0, poll_s=0.1)
    base.update(kw)
    return RunnerSettings(**base)


def spec(trial_id, profile=False):
    return TrialSpec(trial_id, 1, {"stage": 1}, line=-1 if profile else 0, profile=profile)


def run_all(runner, jobs, *, on_start=None):
    """Start jobs [(spec, hparams)] as capacity allows; returns ({id: result}, {id: (start, end)})."""
    pending, results, spans = list(jobs), {}, {}
    while pending or runner.running():
        while pending and runner.capacity() > 0:
            s, hparams = pending.pop(0)
            runner.start(s, ds_config={"train_micro_batch_size_per_gpu": s.micro_batch}, hparams=hparams)
            spans[s.trial_id] = (time.time(), None)
            if on_start:
                on_start(s)
        for r in runner.wait(timeout=200):
            results[r.spec.trial_id] = r
            spans[r.spec.trial_id] = (spans[r.spec.trial_id][0], time.time())
    return results, spans


def marked_processes(root: Path) -> list[int]:
    """Independent of the runner's own scan: processes whose environment names a trial under root."""
    needle = f"TOOLKIT_DSAT_TRIAL={root.resolve()}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            if state != b"Z" and needle in Path(f"/proc/{name}/environ").read_bytes():
                found.append(int(name))
        except (OSError, IndexError):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def wait_for(predicate, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def rank_record(out: Path, trial_id: int, rank: int = 0) -> dict:
    return json.loads((out / "trials" / f"trial_{trial_id}" / f"rank{rank}.json").read_text())


# -- settings (pure) -------------------------------------------------------------------------

def test_settings_list_every_problem(tmp_path):
    with pytest.raises(ConfigError) as err:
        RunnerSettings(entrypoint=(), model_dir=tmp_path / "missing", slots_per_trial=2, max_slots=1,
                       max_concurrent=0, timeout_s=-1, launcher="mpirun", memory_per_slot=0,
                       start_profile_step=0, end_profile_step=5, gpus=(0, 0))
    text = "\n".join(err.value.problems)
    for words in (
        "entrypoint=()",
        "model_dir=",
        "--max-concurrent-trials=0",
        "resources.slots_per_trial=2 > --max-slots=1",
        "--trial-timeout=-1",
        "--launcher='mpirun'",
        "--memory-per-slot=0",
        "--start-profile-step=0",
        "gpus=(0, 0)",
    ):
        assert words in text
    with pytest.raises(ConfigError, match="only 2 GPU"):
        make_settings(gpus=(0, 1), max_slots=4)
    with pytest.raises(ConfigError, match="interpreter option '-O'"):
        make_settings(entrypoint=("python3", "-O", "train.py"))


def test_gpus_are_indices_into_an_inherited_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match="makes only 2 GPU"):
        TrialRunner(make_settings(gpus=(0, 1, 2), max_slots=2), output_dir=tmp_path)
    s = RunnerSettings(
        entrypoint=["python3", "x.py"],
        model_dir=str(tmp_path),
        slots_per_trial=1,
        max_slots=1,
        max_concurrent=1,
        timeout_s=1,
        gpus=[1],
    )
    assert s.entrypoint == ("python3", "x.py") and s.model_dir == tmp_path and s.gpus == (1,)


def test_settings_name_a_bad_multihost_launcher_ssh_port_and_hosts():
    with pytest.raises(ConfigError) as err:
        make_settings(multihost_launcher="mpirun", ssh_port=70000, hosts=[Host("a", 1)])
    assert err.value.problems == [
        "--multihost-launcher='mpirun': expected one of pdsh, openmpi, mvapich, mpich, impi, srun",
        "--ssh-port=70000: expected an integer from 1 to 65535, or None"]
    with pytest.raises(ConfigError) as err:
        make_settings(hosts=[Host("a", 2), Host("a", 2)])
    assert err.value.problems == [
        "hosts=(Host(name='a', slots=2), Host(name='a', slots=2)): expected distinct Host entries "
        "(toolkit.launch.hosts), or None"]
    s = make_settings(hosts=[Host("a", 2), Host("b", 2)], ssh_port=2222)  # a list from the hostfile
    assert s.hosts == (Host("a", 2), Host("b", 2)) and s.ssh_port == 2222


def test_settings_report_a_bad_slot_count_once():
    with pytest.raises(ConfigError) as err:
        make_settings(slots_per_trial=0, max_slots=1)
    assert err.value.problems == ["resources.slots_per_trial=0: expected an integer >= 1"]


def test_the_runner_takes_only_runner_settings(tmp_path):
    with pytest.raises(TypeError, match="settings must be a RunnerSettings, got dict"):
        TrialRunner(dict(entrypoint=("python3", "t.py")), output_dir=tmp_path)
    assert not (tmp_path / "trials").exists()


# -- classification ----------------------------------------------------------------------------

def test_outcomes_are_classified_from_exit_status_and_result_file(tmp_path):
    # Real launches for what only a launch shows (a crash under torchrun's epilogue, a stale result
    # removed, the grandchild killed); a corrupt result or an "oom" one (exit 75) is classified from
    # the same exit status and directory: test_classify.py::test_each_row_of_the_table has those rows
    # (and tests/dsat/trial/test_reporting.py a real OOM under the runner).
    out = tmp_path / "out"
    # a stale result from an earlier run of trial 3 must not be taken for this run's
    stale = out / "trials" / "trial_3" / "result.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"trial_id": 3, "status": "ok", "metrics": dict.fromkeys(METRICS, 1.0)}))
    jobs = [(spec(0, profile=True), {"behaviour": "orphan", "overwrite_deepspeed_args": {"x": 1}, "lr": 0.1}),
            (spec(2), {"behaviour": "crash"}), (spec(3), {"behaviour": "no_result"})]
    with TrialRunner(make_settings(memory_per_slot=4096 * MIB), output_dir=out) as runner:
        results, _ = run_all(runner, jobs)

    ok = results[0]
    assert ok.status is TrialStatus.OK and set(ok.metrics) == set(METRICS) and ok.error is None
    assert ok.metrics["latency"] == 7.5 and ok.duration_s > 0
    assert (
        ok.profile["num_params"] == 676 and ok.profile["memory_per_slot"] == 4096 * MIB
    )  # budget in the contract
    crash = results[2]
    assert crash.status is TrialStatus.FAILED and crash.error.startswith("exit status 1")
    assert "RuntimeError: boom from the fake trial on rank 0" in crash.error  # stderr tail, for display
    assert results[3].status is TrialStatus.FAILED and results[3].error.startswith(
        "exited 0 without a result file"
    )

    # the trial's files and environment
    trial0 = out / "trials" / "trial_0"
    for name in ("ds_config.json", "hparams.json", "trial.json", "trial.log", "launcher.log", "result.json"):
        assert (trial0 / name).is_file(), name
    # each trial's log: its own lines, labelled by rank; the rank's own files under ranks/
    crashed = (out / "trials" / "trial_2" / "trial.log").read_text()
    assert "[rank 0] RuntimeError: boom from the fake trial on rank 0" in crashed
    assert "[launcher]" in crashed and "trial_0" not in crashed and "trial_3" not in crashed
    assert "boom" in (out / "trials" / "trial_2" / "ranks").rglob("stderr.log").__next__().read_text()
    hparams = json.loads((trial0 / "hparams.json").read_text())
    assert hparams == {"behaviour": "orphan", "lr": 0.1, "deepspeed_config": str(trial0 / "ds_config.json")}
    assert json.loads((trial0 / "ds_config.json").read_text()) == {"train_micro_batch_size_per_gpu": 1}
    contract = json.loads((trial0 / "trial.json").read_text())
    assert contract["profile"] is True and contract["result_path"] == str(trial0 / "result.json")
    seen = rank_record(out, 0)
    assert seen["cwd"] == str(WORKERS) and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert seen["env"]["TOOLKIT_DSAT_TRIAL"] == str(trial0 / "trial.json")
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] is None  # no gpus given: left alone
    assert seen["env"]["TOOLKIT_OUTPUT_DIR"] == str(trial0 / "output")  # toolkit.get_output_dir: per trial
    assert seen["env"]["MALLOC_MMAP_THRESHOLD_"] == "131072"  # a CPU budget: glibc's threshold fixed
    ports = {rank_record(out, i)["env"]["MASTER_PORT"] for i in results}
    assert len(ports) == len(results)  # a port per trial

    # the grandchild (own session) outlived its trial's processes: the runner killed it
    grandchild = int((trial0 / "grandchild0.pid").read_text())
    assert not alive(grandchild)
    assert marked_processes(out) == []


# -- limits: timeout, memory, caps -----------------------------------------------------------------

def test_timeout_kills_the_trial_and_its_orphans(tmp_path):
    out = tmp_path / "out"
    # generous enough for torchrun and the workers to start on a loaded 2-core machine
    settings = make_settings(timeout_s=10.0, slots_per_trial=2, max_slots=4, grace_s=1.0)
    with TrialRunner(settings, output_dir=out) as runner:
        started = time.monotonic()
        runner.start(spec(1), ds_config={}, hparams={"behaviour": "hang", "orphan": True})
        # trial 2 ignores SIGTERM: it needs the SIGKILL after the grace
        runner.start(spec(2), ds_config={}, hparams={"behaviour": "ignore_term"})
        results = {}
        while runner.running():
            results.update({r.spec.trial_id: r for r in runner.wait(timeout=60)})
        elapsed = time.monotonic() - started
    assert [r.status for r in results.values()] == [TrialStatus.TIMEOUT] * 2
    assert results[1].error == "ran past the timeout of 10 s"
    assert rank_record(out, 1, 0)["env"]["MALLOC_MMAP_THRESHOLD_"] is None  # no CPU budget: left alone
    assert 10.0 <= elapsed < 2 * (10.0 + 1.0 + 10.0)
    for rank in (0, 1):
        assert not alive(rank_record(out, 1, rank)["pid"])
        assert not alive(int((out / "trials" / "trial_1" / f"grandchild{rank}.pid").read_text()))
    assert not alive(rank_record(out, 2)["pid"])
    assert marked_processes(out) == []


def test_memory_budget_is_enforced_per_worker_on_its_peak(tmp_path):
    # The launcher (torchrun imports torch: ~hundreds of MiB) is not a worker and is not counted, so
    # the small trial passes under the same budget that stops the big one.
    # The big worker touches 400 MiB and frees them within a fraction of a second, then hangs: polls
    # 2 s apart almost never see that resident size (a budget on VmRSS lets the trial run into its
    # timeout), but the peak (VmHWM) stays, as a GPU's allocator would have failed at the peak.
    out = tmp_path / "out"
    settings = make_settings(memory_per_slot=150 * MIB, poll_s=2.0, timeout_s=60.0)
    with TrialRunner(settings, output_dir=out) as runner:
        results, _ = run_all(runner, [(spec(1), {"behaviour": "memory", "alloc_mib": 400, "free": True}),
                                      (spec(2), {"behaviour": "sleep", "sleep_s": 1.0})])
    big = results[1]
    assert big.status is TrialStatus.OOM, big.error
    assert big.error.startswith("peak RSS ") and big.error.endswith(
        "MiB exceeded the memory budget 150 MiB per slot"
    )
    # Above the budget, not necessarily the whole 400 MiB: a poll may land while the block is still
    # being touched (CI once read 396 MiB there), and the runner stops at the first peak over budget.
    assert int(big.error.split()[2]) > 150
    assert results[2].status is TrialStatus.OK, results[2].error
    assert marked_processes(out) == []


def test_a_ranks_op_build_is_not_judged_as_the_trials_memory(tmp_path, caplog):
    """A rank that JIT-builds an op under the budget: the real ninja runs a "compiler" that touches
    400 MiB for a second and a half (cc1plus took 1.8 GB on a real op), under a 150 MiB budget per
    slot. The build is not the trial's memory: the trial is ok, and the log names the op built."""
    from toolkit.runtime.build_env import pinned_ninja

    ninja = pinned_ninja()
    if ninja is None:
        pytest.skip("no ninja here (pip install ninja)")
    out = tmp_path / "out"
    settings = make_settings(memory_per_slot=150 * MIB, poll_s=0.1, timeout_s=60.0)
    with caplog.at_level("WARNING", logger="toolkit.dsat.execution.runner"), \
            TrialRunner(settings, output_dir=out) as runner:
        results, _ = run_all(runner, [(spec(1), {"behaviour": "build", "ninja": ninja, "alloc_mib": 400,
                                                 "hold_s": 1.5})])
    assert results[1].status is TrialStatus.OK, results[1].error
    assert (out / "trials" / "trial_1" / "fake_op0" / "fake_op.so").exists()
    assert caplog.text.count("its ranks build op fake_op0") == 1, caplog.text


_FORK_THEN_EXEC = """
import os, sys, time
ballast = bytearray(b"x") * (300 << 20)  # touched: resident, like torchrun's imports
pid = os.fork()
if pid == 0:
    time.sleep(2)  # a fork that has not exec'd yet
    os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"],
              {**os.environ, "LOCAL_RANK": "0"})
print(pid, flush=True)
os.waitpid(pid, 0)
"""


def test_a_launchers_fork_before_its_exec_is_not_held_to_the_budget():
    # Seen in CI: torchrun's fork of a worker, caught before its exec, showed torchrun's own RSS
    # (222 MiB) and failed a trial of tiny workers. Real processes: a big parent forks a child that
    # waits before exec'ing into a small "rank" (LOCAL_RANK set, as the launchers do).
    from toolkit.launch.procs import is_rank_process, rss_bytes, scan_processes

    parent = subprocess.Popen([sys.executable, "-c", _FORK_THEN_EXEC], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        before = scan_processes()[child][1]
        assert not is_rank_process(before)          # still the parent's environment ...
        assert rss_bytes(child) > 250 * MIB         # ... and the parent's memory
        deadline = time.monotonic() + 30
        while not is_rank_process(scan_processes().get(child, (0, b""))[1]):
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.05)
        assert rss_bytes(child) < 100 * MIB         # the rank itself is small
    finally:
        parent.kill()
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        parent.wait(timeout=30)
        parent.stdout.close()


def overlap(spans):
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda p: (p[0], p[1]))
    level = peak = 0
    for _, step in points:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("slots_per_trial, max_slots, max_concurrent, cap, visible", [
    (1, 3, 2, 2, "10,11,12,13,14,15,16,17,18"),   # under an inherited CUDA_VISIBLE_DEVICES (Slurm)
    (2, 3, 4, 1, None),
])
def test_slot_and_concurrency_caps_are_never_exceeded(tmp_path, monkeypatch, capsys, slots_per_trial,
                                                      max_slots, max_concurrent, cap, visible):
    out = tmp_path / "out"
    gpus = (4, 6, 8)
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    physical = {str(int(visible.split(",")[g]) if visible else g) for g in gpus}
    n = cap + 1  # one more trial than may run at once
    settings = make_settings(
        slots_per_trial=slots_per_trial, max_slots=max_slots, max_concurrent=max_concurrent, gpus=gpus
    )
    capacities = []
    with TrialRunner(settings, output_dir=out) as runner:
        results, spans = run_all(
            runner,
            [(spec(i), {"behaviour": "sleep", "sleep_s": 1.0}) for i in range(n)],
            on_start=lambda s: capacities.append(runner.capacity()),
        )
    assert all(r.status is TrialStatus.OK for r in results.values())
    assert min(capacities) >= 0
    # the runner's view (start() to result) and the workers' own clocks
    assert overlap(list(spans.values())) <= cap
    worker_spans = [(rec["start"], rec["end"]) for i in range(n) for rec in
                    [rank_record(out, i, rank) for rank in range(slots_per_trial)]]
    assert overlap(worker_spans) <= cap * slots_per_trial
    # GPUs: each trial gets slots_per_trial of them, never one held by an overlapping trial
    held = {i: rank_record(out, i)["env"]["CUDA_VISIBLE_DEVICES"].split(",") for i in range(n)}
    for i in range(n):
        assert len(held[i]) == slots_per_trial and set(held[i]) <= physical
        for j in range(i + 1, n):
            (a0, a1), (b0, b1) = spans[i], spans[j]
            if a0 < b1 and b0 < a1:
                assert not set(held[i]) & set(held[j])
    # trials at once: each one's log holds its own ranks' lines, and the console names the trial of each
    for i in range(n):
        lines = (out / "trials" / f"trial_{i}" / "trial.log").read_text().splitlines()
        assert sorted(line for line in lines if "fake trial" in line) == [
            f"[rank {r}] fake trial {i} on rank {r}" for r in range(slots_per_trial)], lines
    shown = [line for line in capsys.readouterr().out.splitlines() if "fake trial" in line]
    assert sorted(shown) == sorted(f"[trial {i} rank {r}] fake trial {i} on rank {r}"
                                   for i in range(n) for r in range(slots_per_trial))
    assert marked_processes(out) == []


def test_start_refuses_past_capacity_a_killed_launcher_leaves_no_orphans_and_shutdown_is_final(tmp_path):
    # One launch for both: the refusals while it runs, then its launcher's SIGKILL. Shutdown with a
    # trial still running is test_ctrl_c_leaves_no_process_behind (the runner's exit on Ctrl-C).
    out = tmp_path / "out"
    runner = TrialRunner(make_settings(slots_per_trial=2, max_concurrent=1), output_dir=out)
    runner.start(spec(1), ds_config={}, hparams={"behaviour": "hang"})
    assert runner.capacity() == 0 and runner.running() == 1
    with pytest.raises(ValueError, match="already running"):
        runner.start(spec(1), ds_config={}, hparams={"behaviour": "hang"})
    with pytest.raises(ValueError, match="no free capacity"):
        runner.start(spec(2), ds_config={}, hparams={"behaviour": "hang"})
    assert runner.wait(timeout=0.3) == []
    trial_dir = out / "trials" / "trial_1"
    wait_for(lambda: all((trial_dir / f"rank{r}.json").exists() for r in (0, 1)))
    workers = [rank_record(out, 1, r)["pid"] for r in (0, 1)]
    launcher = int(Path(f"/proc/{workers[0]}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    assert set(workers) <= find_trial_processes(trial_dir / "trial.json")
    os.kill(launcher, signal.SIGKILL)   # torchrun dies without stopping its workers
    results = runner.wait(timeout=60)
    assert [r.status for r in results] == [TrialStatus.FAILED]
    assert results[0].error.startswith("killed by signal SIGKILL")
    assert not any(alive(pid) for pid in workers) and marked_processes(out) == []
    runner.shutdown()
    runner.shutdown()  # idempotent
    assert runner.capacity() == 0 and runner.running() == 0 and runner.wait() == []
    with pytest.raises(ValueError, match="shut down"):
        runner.start(spec(3), ds_config={}, hparams={"behaviour": "ok"})
    assert marked_processes(out) == []


def test_deepspeed_launcher_runs_the_trial_on_two_processes(tmp_path):
    out = tmp_path / "out"
    with TrialRunner(make_settings(launcher="deepspeed", slots_per_trial=2), output_dir=out) as runner:
        results, _ = run_all(runner, [(spec(1), {"behaviour": "ok"})])
    assert results[1].status is TrialStatus.OK, results[1].error
    assert results[1].profile is None
    records = [rank_record(out, 1, r) for r in (0, 1)]
    assert [r["env"]["WORLD_SIZE"] for r in records] == ["2", "2"]
    assert all(not any(a.startswith("--local_rank") for a in r["argv"]) for r in records)
    # DeepSpeed's launcher writes a file per rank (--enable_each_rank_log): the trial's log labels each line
    trial = out / "trials" / "trial_1"
    assert sorted(p.name.rsplit("_", 1)[1] for p in (trial / "ranks").iterdir()) == ["rank0.log", "rank1.log"]
    log = (trial / "trial.log").read_text().splitlines()
    assert {"[rank 0] fake trial 1 on rank 0", "[rank 1] fake trial 1 on rank 1"} <= set(log), log
    assert marked_processes(out) == []


CTRL_C_SCRIPT = """
import signal, sys, time
# As in a terminal: a suite started in the background (``cmd &``, nohup) passes SIGINT ignored to
# its children, and Python then installs no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
out = Path(sys.argv[1])
settings = RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py"), model_dir=sys.argv[2],
                          slots_per_trial=2, max_slots=2, max_concurrent=2, timeout_s=300, grace_s=2)
with TrialRunner(settings, output_dir=out) as runner:
    runner.start(TrialSpec(1, 1, {"stage": 1}, line=0), ds_config={},
                 hparams={"behaviour": "hang", "orphan": True})
    while not all((out / "trials" / "trial_1" / f"grandchild{r}.pid").exists() for r in (0, 1)):
        time.sleep(0.05)
    print("running", flush=True)
    while True:
        runner.wait(timeout=1)
"""


def test_ctrl_c_leaves_no_process_behind(tmp_path):
    out = tmp_path / "out"
    script = tmp_path / "autotuner.py"
    script.write_text(CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(WORKERS)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # DeepSpeed, imported to build the trial's ops first, may print its own lines before
        lines = [proc.stdout.readline().strip()]
        while lines[-1] != "running" and lines[-1] != "" and len(lines) < 50:
            lines.append(proc.stdout.readline().strip())
        assert lines[-1] == "running", lines
        pids = [rank_record(out, 1, r)["pid"] for r in (0, 1)]
        pids += [int((out / "trials" / "trial_1" / f"grandchild{r}.pid").read_text()) for r in (0, 1)]
        assert all(alive(pid) for pid in pids)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert not any(alive(pid) for pid in pids)
    assert marked_processes(out) == []


def test_leftovers_of_a_killed_autotuner_are_killed_by_the_next_runner(tmp_path):
    # An autotuner killed with SIGKILL cannot clean up; its trials' processes keep their mark.
    out = tmp_path / "out"
    mark = str((out / "trials" / "trial_9" / "trial.json").resolve())
    env = dict(os.environ, TOOLKIT_DSAT_TRIAL=mark)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env,
                              start_new_session=True)
    try:
        wait_for(lambda: marked_processes(out) == [orphan.pid])
        with TrialRunner(make_settings(), output_dir=out):
            assert orphan.wait(timeout=30) == -signal.SIGTERM
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait(timeout=30)
    assert marked_processes(out) == []


FULL_RUN_SCRIPT = """
import json, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
seen = {k: os.environ.get(k) for k in ("TOOLKIT_DSAT_TRIAL", "TOOLKIT_DSAT_RUN", "X")}
json.dump({"child": child.pid, "env": seen}, open("seen.json", "w"))
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("sleep_s, exit_code, timeout_s, expected", [(0, 3, 60, 3), (600, 0, 3.0, 124)])
def test_run_to_completion_returns_the_status_and_leaves_nothing(tmp_path, monkeypatch, sleep_s, exit_code,
                                                                 timeout_s, expected):
    from toolkit.launch.procs import run_to_completion
    script = tmp_path / "job.py"
    script.write_text(FULL_RUN_SCRIPT)
    monkeypatch.setenv("TOOLKIT_DSAT_TRIAL", "/not/a/trial.json")  # never leaks into the full run
    code = run_to_completion([sys.executable, str(script), str(sleep_s), str(exit_code)], cwd=tmp_path,
                             env={"X": "1"}, log_dir=tmp_path / "logs", timeout_s=timeout_s, grace_s=1.0)
    assert code == expected
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["env"] == {"TOOLKIT_DSAT_TRIAL": None, "TOOLKIT_DSAT_RUN": str((tmp_path / "logs").resolve()),
                           "X": "1"}
    assert not alive(seen["child"])  # the grandchild in its own session did not outlive the job
    assert (tmp_path / "logs" / "stdout.log").exists()


def test_a_trial_is_told_the_experiment_config(tmp_path):
    """TOOLKIT_EXPERIMENT_CONFIG reaches every trial (det.get_cluster_info() reads the YAML there)."""
    config = tmp_path / "deepspeed.yaml"
    with TrialRunner(make_settings(experiment_config=config), output_dir=tmp_path) as runner:
        env, _include = runner._trial_env(tmp_path, None)
    assert env["TOOLKIT_EXPERIMENT_CONFIG"] == str(config)
    with TrialRunner(make_settings(), output_dir=tmp_path / "b") as runner:
        env, _include = runner._trial_env(tmp_path, None)
    assert env.get("TOOLKIT_EXPERIMENT_CONFIG") == os.environ.get("TOOLKIT_EXPERIMENT_CONFIG")
