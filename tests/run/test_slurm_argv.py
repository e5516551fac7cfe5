"""``toolkit.run --slurm``'s decisions, without a cluster: the sbatch options, the sbatch argv, the job
script, squeue's states, how an ended job leaves its trial, and the CLI's refusals (exit 2, nothing
written). The real search on Slurm: tests/cluster/test_slurm_engine.py."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.errors import ConfigError
from toolkit.run.cli import _joined_slurm, main
from toolkit.run.plan import RunPlan
from toolkit.run.search_state import TrialRecord
from toolkit.run.slurm_argv import (
    DEFAULT_SIGNAL,
    job_script,
    parse_options,
    parse_squeue,
    sbatch_argv,
    scancel_argv,
    squeue_argv,
)
from toolkit.run.slurm_engine import _ended, _Job, _JobForwarder


def test_options_are_shell_words_and_empty_is_none():
    assert parse_options("--partition=gpu --time 60 --comment='a b'") == [
        "--partition=gpu", "--time", "60", "--comment=a b"]
    assert parse_options("") == []


@pytest.mark.parametrize("text, named", [
    ("--output=x.log", "--output"), ("-ox.log", "--output"), ("-e err", "--error"), ("--chdir=/x", "--chdir"),
    ("--array=0-3", "--array"), ("--wrap=true", "--wrap"), ("--wait", "--wait"), ("-J name", "--job-name"),
    ("--parsable", "--parsable"),
])
def test_options_toolkit_sets_itself_are_refused_naming_the_flag(text, named):
    with pytest.raises(ConfigError) as err:
        parse_options(f"--time=5 {text}")
    assert "--slurm" in str(err.value) and named in str(err.value) and "leave it out" in str(err.value)


def test_unbalanced_quotes_and_a_first_word_that_is_no_option_are_refused():
    with pytest.raises(ConfigError, match=r"--slurm='--comment=\"a': cannot be split"):
        parse_options('--comment="a')
    with pytest.raises(ConfigError, match=r"expected sbatch options .* got 'gpu' first"):
        parse_options("gpu --time=5")


def test_sbatch_argv_one_task_of_nproc_cpus_the_warning_signal_and_the_options_last():
    argv = sbatch_argv(["--partition=x", "--time=10"], script=Path("/o/t/slurm_job.sh"), job_name="exp.t",
                       output=Path("/o/t/slurm-%j.out"), chdir=Path("/m"), nproc=2)
    assert argv == ["sbatch", "--parsable", "--job-name=exp.t", "--output=/o/t/slurm-%j.out",
                    "--open-mode=append", "--chdir=/m", "--nodes=1", "--ntasks=1", "--cpus-per-task=2",
                    DEFAULT_SIGNAL, "--partition=x", "--time=10", "/o/t/slurm_job.sh"]
    assert DEFAULT_SIGNAL == "--signal=USR1@180"


@pytest.mark.parametrize("given", [["--signal=B:USR1@60"], ["--signal", "TERM@300"]])
def test_a_signal_in_the_options_replaces_the_default(given):
    argv = sbatch_argv(given, script=Path("s.sh"), job_name="j", output=Path("o"), chdir=Path("m"), nproc=1)
    assert DEFAULT_SIGNAL not in argv and argv[-1 - len(given):-1] == given


def test_job_script_is_one_srun_step_with_the_stop_signals_blocked_until_the_trial_handles_them(tmp_path):
    spec = tmp_path / "dir with space" / "slurm_trial.json"
    text = job_script("/venv/bin/python", spec, trial="trial-0003")
    lines = text.splitlines()
    assert lines[:2] == ["#!/bin/sh", "# trial-0003 of a search (written by python -m toolkit.run --slurm)"]
    assert lines[2].startswith("exec srun --ntasks=1 --kill-on-bad-exit=1 /venv/bin/python -c ")
    assert len(lines) == 3
    # the shell hands Python the code and the spec as two words (the spec path keeps its space)
    script = tmp_path / "job.sh"
    script.write_text(text.replace("exec srun --ntasks=1 --kill-on-bad-exit=1 /venv/bin/python",
                                   f"exec {sys.executable} -c 'import sys; print(sys.argv[1:])' "))
    out = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=30, check=True).stdout
    assert "runpy.run_module('toolkit.run.slurm_job'" in out and f"'{spec}'" in out
    assert "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})" in out


def test_squeue_and_scancel_argv_and_states():
    assert squeue_argv() == ["squeue", "--noheader", "--me", "--states=all", "--format=%i|%T"]
    assert scancel_argv("12") == ["scancel", "12"]
    assert scancel_argv("12", signal_name="USR1") == ["scancel", "--signal=USR1", "12"]
    assert parse_squeue("12|RUNNING\n 13|COMPLETED \n\nbad\n14|PENDING extra\n") == {
        "12": "RUNNING", "13": "COMPLETED", "14": "PENDING"}


def test_slurm_value_that_starts_with_a_dash_reaches_argparse_as_one_value():
    assert _joined_slurm(["a.yaml", ".", "--slurm", "--time=5", "--grace", "3"]) == [
        "a.yaml", ".", "--slurm=--time=5", "--grace", "3"]
    assert _joined_slurm(["--slurm"]) == ["--slurm"]  # argparse then says it needs a value


def _job(tmp_path: Path, *, max_restarts: int = 1) -> _Job:
    plan = RunPlan(launcher="torchrun", command=["python3", "t.py"], nproc=1, max_restarts=max_restarts,
                   output_dir=tmp_path, config_path=tmp_path / "e.yaml", model_dir=tmp_path)
    forwarder = _JobForwarder()
    forwarder.job = "7"
    return _Job(TrialRecord(index=0, hparams={}), plan, forwarder, watcher=None)  # type: ignore[arg-type]


def test_an_ended_job_is_submitted_again_when_preempted_or_lost_within_max_restarts(tmp_path):
    job = _job(tmp_path, max_restarts=1)
    assert _ended(job, {"status": 0, "received": "SIGUSR1"}, pausing=False) is None  # preempted: again
    assert _ended(job, {"status": 0, "received": None}, pausing=False) == 0  # done
    assert _ended(job, {"status": 3, "received": None}, pausing=False) == 3  # the trial's own failure
    assert _ended(job, None, pausing=False) is None  # no result (killed): again, once
    assert _ended(job, None, pausing=False) == 1  # max_restarts=1 reached
    assert _ended(job, {"status": 0, "received": "SIGUSR1"}, pausing=True) == 0  # paused: recorded
    assert _ended(job, None, pausing=True) == 0
    stopped = _job(tmp_path)
    stopped.forwarder.searcher_stopped = stopped.forwarder.searcher_sent = True
    assert _ended(stopped, {"status": 0, "received": "SIGUSR1"}, pausing=False) == 0  # ASHA's stop: done


def _experiment(tmp_path: Path, searcher: str = "random") -> Path:
    config = tmp_path / "e.yaml"
    config.write_text(yaml.safe_dump({
        "name": "s", "entrypoint": "python3 t.py", "hyperparameters": {"x": {"type": "int", "minval": 1,
                                                                            "maxval": 3}},
        "searcher": {"name": searcher, "metric": "x", "max_trials": 2, "max_length": 1}}))
    return config


@pytest.mark.parametrize("flags, named", [
    (["--slurm", "--output=x"], "--output"),
    (["--slurm", "--time=5", "--max-slots", "2"], "--max-slots=2"),
    (["--slurm", "'unbalanced"], "--slurm"),
])
def test_cli_refuses_bad_slurm_input_with_exit_2_and_writes_nothing(tmp_path, capsys, flags, named):
    out = tmp_path / "out"
    assert main([str(_experiment(tmp_path)), str(tmp_path), "--output-dir", str(out), *flags]) == 2
    assert named in capsys.readouterr().err and not out.exists()


def test_cli_refuses_slurm_for_a_single_run(tmp_path, capsys):
    out = tmp_path / "out"
    config = _experiment(tmp_path, "single")
    assert main([str(config), str(tmp_path), "--output-dir", str(out), "--slurm", "--time=5"]) == 2
    err = capsys.readouterr().err
    assert "--slurm" in err and "searcher.name is 'single'" in err and not out.exists()
