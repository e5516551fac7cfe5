"""dsat across hosts: the multi-host argv compared exactly (and checked against DeepSpeed's own
parser), and real trials placed on a 2-"host" localhost hostfile (the hosts' parsing and the
placement itself: tests/launch/test_hosts.py).

What runs here: the hosts of the hostfile tests are loopback names of this machine, so their
trials take the local path (torchrun, no ssh). The pdsh path across hosts runs for real in
tests/runtime/test_multinode.py only where sshd and pdsh exist; Slurm (srun) cannot run here: only its
argv and the parsing of its variables are tested.
"""

import dataclasses
import json
import os
import sys

import pytest

from helpers import procutil
from helpers.dsatcli import dsat, dsat_in_process, make_model_dir, trial_rows
from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.execution.multihost_argv import build_multihost_argv, build_remote_kill_argv
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
from toolkit.errors import ConfigError
from toolkit.launch.hosts import Host
from toolkit.launch.procs import find_trial_processes

PY = sys.executable


# ---------------------------------------------------------------- multi-host argv, compared exactly
PLACEMENT = {"worker-0": (0, 1), "worker-1": (0,)}
RUNNER = [PY, "-m", "deepspeed.launcher.runner", "--hostfile", "/out/trials/trial_3/hostfile"]
# pdsh trials go through toolkit's subclass of DeepSpeed's runner, which quotes the remote line
PDSH_RUNNER = [PY, "-m", "toolkit.dsat.execution.pdsh_launch", "--hostfile", "/out/trials/trial_3/hostfile"]
TAIL = ["--master_addr", "worker-0", "--master_port", "29512"]


@pytest.mark.parametrize(
    "via, entrypoint, expected",
    [
        (
            "pdsh",
            ["python3", "train.py", "--lr", "0.1"],
            PDSH_RUNNER
            + ["--include", "worker-0:0,1@worker-1:0"]
            + TAIL
            + ["--launcher", "pdsh", "--force_multi", "--no_local_rank", "train.py", "--lr", "0.1"],
        ),
        (
            "pdsh",
            ["python3", "-m", "pkg.train"],
            PDSH_RUNNER
            + ["--include", "worker-0:0,1@worker-1:0"]
            + TAIL
            + ["--launcher", "pdsh", "--force_multi", "--no_local_rank", "--module", "pkg.train"],
        ),
        (
            "openmpi",
            ["bash", "run.sh"],
            RUNNER
            + TAIL
            + ["--launcher", "openmpi", "--force_multi", "--no_local_rank", "--no_python", "bash", "run.sh"],
        ),
        (
            "mvapich",
            ["torchrun", "--nproc_per_node", "8", "train.py", "x"],
            RUNNER + TAIL + ["--launcher", "mvapich", "--force_multi", "--no_local_rank", "train.py", "x"],
        ),
    ],
)
def test_deepspeed_runner_argv(via, entrypoint, expected):
    assert build_multihost_argv(entrypoint, placement=PLACEMENT, via=via, master_port=29512,
                                hostfile="/out/trials/trial_3/hostfile") == expected


def test_srun_argv_and_ssh_port():
    placement = {"node01": (0, 1), "node02": (0, 1)}
    assert build_multihost_argv(
        ["python3", "train.py", "a b"], placement=placement, via="srun", master_port=29600
    ) == [
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--nodelist=node01,node02",
        "--exact",
        "--kill-on-bad-exit=1",
        "--export=ALL,MASTER_ADDR=node01,MASTER_PORT=29600",
        PY,
        "-u",
        "train.py",
        "a b",
    ]
    assert build_multihost_argv(["./run.sh"], placement=placement, via="srun", master_port=29600, gpus=True)[
        -2:
    ] == ["--gpus-per-node=2", "./run.sh"]
    with pytest.raises(ValueError, match="srun starts the same number of tasks on every host"):
        build_multihost_argv(["python3", "t.py"], placement=PLACEMENT, via="srun", master_port=29600)
    argv = build_multihost_argv(
        ["python3", "t.py"], placement=PLACEMENT, via="pdsh", master_port=1, hostfile="h", ssh_port=2222
    )
    assert argv[-4:] == ["--no_local_rank", "--ssh_port", "2222", "t.py"]
    assert build_remote_kill_argv(["worker-0", "worker-1"], master_port=29512) == [
        "pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "pkill", "-TERM", "-f",
        "'[d]eepspeed.launcher.launch.*--master_port=29512( |$)'"]


@pytest.mark.parametrize("kw, fragment", [
    (dict(via="ssh"), "via='ssh': expected one of pdsh"),
    (dict(placement={}), "expected a non-empty mapping"),
    (dict(placement={"a b": (0,)}), "host 'a b'"),
    (dict(placement={"a": (0, 0)}), "distinct slot ids"),
    (dict(master_port=0), "master_port=0"),
    (dict(hostfile=None), "needs the trial's hostfile"),
    (dict(ssh_port=70000), "ssh_port=70000"),
])
def test_multihost_argv_errors(kw, fragment):
    args = dict(placement=PLACEMENT, via="pdsh", master_port=29512, hostfile="h")
    args.update(kw)
    with pytest.raises(ValueError, match=fragment.replace("(", "\\(")):
        build_multihost_argv(["python3", "t.py"], **args)


def test_deepspeed_reads_our_argv_as_meant(tmp_path):
    """DeepSpeed's own parser and resource filter turn our argv into our placement, and its pdsh
    runner builds a command for both hosts that exports the trial's variables (nothing is run)."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import (
        encode_world_info,
        fetch_hostfile,
        parse_args,
        parse_inclusion_exclusion,
    )

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=1\n")
    argv = build_multihost_argv(
        ["python3", "train.py", "--x"], placement=PLACEMENT, via="pdsh", master_port=29512, hostfile=hostfile
    )
    args = parse_args(argv[3:])
    assert (args.hostfile, args.include, args.master_addr, args.master_port, args.launcher) == (
        str(hostfile), "worker-0:0,1@worker-1:0", "worker-0", 29512, "pdsh")
    assert (
        args.force_multi
        and args.no_local_rank
        and args.user_script == "train.py"
        and args.user_args == ["--x"]
    )
    active = parse_inclusion_exclusion(fetch_hostfile(args.hostfile), args.include, args.exclude)
    assert {h: tuple(ids) for h, ids in active.items()} == PLACEMENT
    runner = PDSHRunner(args, encode_world_info(active))
    runner.add_export("TOOLKIT_DSAT_TRIAL", "/out/trials/trial_3/trial.json")
    cmd, kill, _ = runner.get_cmd({}, active)
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert "export TOOLKIT_DSAT_TRIAL=/out/trials/trial_3/trial.json; " in cmd
    assert "--node_rank=%n" in cmd and "--master_port=29512" in cmd and cmd[-2:] == ["train.py", "--x"]


# ---------------------------------------------------------------- real trials on a 2-"host" hostfile
@pytest.fixture()
def clean_env(monkeypatch):
    procutil.clean_launch_env(monkeypatch)
    monkeypatch.setenv(procutil.SESSION_ENV, procutil.SESSION_ID)


LOCAL_HOSTS = (Host("localhost", 2), Host("127.0.0.1", 2))


def test_capacity_follows_placement(tmp_path):
    def runner(slots):
        return TrialRunner(RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py"),
                                          model_dir=procutil.WORKERS, slots_per_trial=slots, max_slots=4,
                                          max_concurrent=4, timeout_s=60, hosts=LOCAL_HOSTS),
                           output_dir=tmp_path / str(slots))
    assert runner(2).capacity() == 2
    assert runner(3).capacity() == 1
    assert runner(1).capacity() == 4
    with pytest.raises(ConfigError, match="--max-slots=5 but the hosts have 4 slot"):
        RunnerSettings(entrypoint=("python3", "t.py"), model_dir=procutil.WORKERS, slots_per_trial=1,
                       max_slots=5, max_concurrent=1, timeout_s=1, hosts=LOCAL_HOSTS)
    with pytest.raises(ConfigError,
                       match="resources.slots_per_trial=3 cannot be placed .* on each host \\(srun\\)"):
        RunnerSettings(entrypoint=("python3", "t.py"), model_dir=procutil.WORKERS, slots_per_trial=3,
                       max_slots=4, max_concurrent=1, timeout_s=1, hosts=LOCAL_HOSTS,
                       multihost_launcher="srun")


def test_trials_are_placed_on_both_hosts_and_recorded(tmp_path, clean_env):
    """2 trials of 2 slots at once, on localhost:2 + 127.0.0.1:2; then one of 3 slots spans both.
    (Slots freed on either host taken again: test_dsat_search_with_a_two_host_hostfile_uses_both_hosts,
    6 trials 2 at a time.)"""
    settings_ = RunnerSettings(
        entrypoint=("python3", "dsat_fake_trial.py"),
        model_dir=procutil.WORKERS,
        slots_per_trial=2,
        max_slots=4,
        max_concurrent=2,
        timeout_s=120,
        grace_s=2,
        poll_s=0.1,
        hosts=LOCAL_HOSTS,
    )
    out = tmp_path / "out"
    with TrialRunner(settings_, output_dir=out) as runner:
        pending, results, overlap = [TrialSpec(i, 1, {"stage": 1}, line=0) for i in range(1, 3)], [], 0
        while pending or runner.running():
            while pending and runner.capacity():
                runner.start(pending.pop(0), ds_config={}, hparams={"behaviour": "sleep", "sleep_s": 1.0})
            overlap = max(overlap, runner.running())
            assert runner.capacity() == 2 - runner.running()
            results += runner.wait(timeout=60)
    assert sorted(r.spec.trial_id for r in results) == [1, 2]
    assert all(r.status is TrialStatus.OK for r in results), [r.error for r in results]
    records = [
        json.loads((out / "trials" / f"trial_{i}" / "placement.json").read_text()) for i in range(1, 3)
    ]
    assert all(r["launch"] == "local" and r["argv"][2] == "torch.distributed.run" for r in records)
    assert {h for r in records for h in r["hosts"]} == {"localhost", "127.0.0.1"}
    assert overlap == 2
    # a trial larger than one host spans both; they are this machine, so it starts locally on 3 processes
    with TrialRunner(dataclasses.replace(settings_, slots_per_trial=3), output_dir=out) as runner:
        runner.start(TrialSpec(5, 1, {"stage": 1}, line=0), ds_config={}, hparams={"behaviour": "ok"})
        assert runner.capacity() == 0
        (result,) = runner.wait(timeout=120)
    record = json.loads((out / "trials" / "trial_5" / "placement.json").read_text())
    assert result.status is TrialStatus.OK, result.error
    assert (
        record["hosts"] == {"localhost": [0, 1], "127.0.0.1": [0]}
        and record["include"] == "localhost:0,1@127.0.0.1:0"
    )
    assert record["argv"][3:5] == ["--nproc_per_node", "3"]
    ranks = sorted((out / "trials" / "trial_5").glob("rank*.json"))
    assert len(ranks) == 3
    assert not find_trial_processes(f"{out / 'trials'}{os.sep}", prefix=True)


def test_dsat_search_with_a_two_host_hostfile_uses_both_hosts(tmp_path):
    """Acceptance: the dsat CLI with a 2-host localhost hostfile completes; trials ran on both hosts."""
    model_dir = make_model_dir(tmp_path, slots=2, hparams={"sleep_s": 0.5})
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    out = tmp_path / "out"
    result = dsat(model_dir, "--hostfile", str(hostfile), "--max-trials", "6", "--zero-stages", "1",
                  "--max-concurrent-trials", "2", "--memory-per-slot", "100MiB")
    assert result.returncode == 0, result.stdout[-4000:]
    rows = trial_rows(out)
    assert len(rows) == 6 and all(r["status"] in ("ok", "oom") for r in rows)
    records = {int(d.name.split("_")[1]): json.loads((d / "placement.json").read_text())
               for d in (out / "trials").iterdir()}
    assert sorted(records) == list(range(6))
    assert {h for r in records.values() for h in r["hosts"]} == {"localhost", "127.0.0.1"}
    assert all(r["launch"] == "local" and sum(map(len, r["hosts"].values())) == 2 for r in records.values())


def test_bad_hostfile_is_a_usage_error(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path, slots=2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\nnode slots=two\n")
    code, text = dsat_in_process(model_dir, "--hostfile", str(hostfile), capsys=capsys)
    assert code == 2 and f"hostfile {hostfile}, line 2: slots='two' for 'node'" in text
    hostfile.write_text("localhost slots=1\n")
    code, text = dsat_in_process(model_dir, "--hostfile", str(hostfile), capsys=capsys)
    assert code == 2 and "resources.slots_per_trial=2 > --max-slots=1" in text
    assert not (tmp_path / "out").exists()
