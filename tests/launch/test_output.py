"""toolkit.launch.output: the pure parts, and the pump on files written as the launchers write them
(the launchers themselves write them in tests/dsat/execution/test_runner.py, under torchrun and
DeepSpeed's launcher, and tests/run/test_scheduler.py, a concurrent search)."""

import sys
from pathlib import Path

import pytest

from toolkit.launch.argv import build_trial_argv
from toolkit.launch.output import MAX_LINE, OutputPump, rank_log_options, rank_of, split_lines


def test_lines_end_at_newlines_and_carriage_returns_and_long_ones_are_cut():
    assert split_lines(b"a\nb\r\nc") == ([b"a", b"b"], b"c")
    assert split_lines(b"10%\r20%\r") == ([b"10%"], b"20%\r")  # a progress bar: each redraw a line
    assert split_lines(b"20%\r" + b"\ndone\n") == ([b"20%", b"done"], b"")  # a \r\n split over two reads
    assert split_lines(b"tail", final=True) == ([b"tail"], b"")
    lines, rest = split_lines(b"x" * (2 * MAX_LINE + 5))
    assert [len(x) for x in lines] == [MAX_LINE, MAX_LINE] and rest == b"xxxxx"


def test_each_launchers_files_name_their_rank_and_stream():
    assert rank_of("none_ab12/attempt_0/1/stdout.log") == (1, "out")
    assert rank_of("none_ab12/attempt_3/12/stderr.log") == (12, "err")
    assert rank_of("20260101120000_rank7.log") == (7, "out")
    assert rank_of("none_ab12/attempt_0/1/error.json") == (None, "")
    assert rank_of("sub/20260101120000_rank7.log") == (None, "")
    with pytest.raises(ValueError, match="launcher='mpirun'"):
        rank_log_options("mpirun", Path("/x"))


@pytest.mark.parametrize("launcher,mode,flag", [("torchrun", ["-m", "pkg.train"], "--module"),
                                                ("deepspeed", ["-m", "pkg.train"], "--module"),
                                                ("torchrun", ["./run.sh"], "--no-python")])
def test_rank_logs_go_before_the_mode_and_the_script(launcher, mode, flag):
    argv = build_trial_argv(["python3", *mode] if mode[0] == "-m" else mode, launcher=launcher, nproc=2,
                            master_port=29511, rank_logs=Path("/t/ranks"))
    options = rank_log_options(launcher, Path("/t/ranks"))
    at = argv.index(options[0])
    assert argv[at:at + len(options)] == options and at < argv.index(flag) < len(argv) - 1
    assert build_trial_argv(["python3", "t.py"], launcher=launcher, nproc=2, master_port=29511)[-1] == "t.py"


def test_the_pump_labels_every_line_by_rank_keeps_what_was_there_and_reads_to_the_end(tmp_path, capsys):
    trial = tmp_path / "trial-0001"
    rank1 = trial / "ranks" / "none_x" / "attempt_0" / "1"
    rank1.mkdir(parents=True)
    (rank1 / "stdout.log").write_bytes(b"an earlier run's line\n")  # a resumed trial: not shown again
    pump = OutputPump(trial, label="trial-0001", echo=True, fresh=False)
    pump.start()
    rank0 = trial / "ranks" / "none_y" / "attempt_0" / "0"
    rank0.mkdir(parents=True)
    with open(rank0 / "stdout.log", "wb") as out, open(rank1 / "stdout.log", "ab") as out1, \
            pump.launcher_file() as launcher:
        out.write(b"step 1 loss 0.5\nstep 2 lo")     # a line still being written
        out1.write(b"hello from 1\n")
        launcher.write(b"torchrun: starting\n")
    (rank0 / "stderr.log").write_bytes(b"Traceback (most recent call last):\nRuntimeError: boom")
    pump.stop()                                       # the launcher exited: everything is read
    log = (trial / "trial.log").read_text().splitlines()
    assert sorted(log) == sorted(["[rank 0] step 1 loss 0.5", "[rank 0] step 2 lo", "[rank 1] hello from 1",
                                  "[launcher] torchrun: starting",
                                  "[rank 0] Traceback (most recent call last):",
                                  "[rank 0] RuntimeError: boom"])
    console = capsys.readouterr()
    assert "[trial-0001 rank 0] step 1 loss 0.5\n" in console.out
    assert "[trial-0001 rank 1] hello from 1\n" in console.out
    assert "[trial-0001 rank 0] RuntimeError: boom\n" in console.err
    assert "[trial-0001] torchrun: starting" in console.err
    assert "earlier" not in console.out + "".join(log)
    text = pump.failure_text("trial-0001: the run failed with exit status 1")
    assert text.startswith("trial-0001: the run failed with exit status 1; its last lines (whole log: "
                           f"{trial / 'trial.log'}):") and text.endswith("\n  [rank 0] RuntimeError: boom")
    # quiet, a fresh trial (dsat reruns a trial id), no launcher lines on the console
    quiet = OutputPump(trial, label="trial 3", echo=False, fresh=True)
    assert not (trial / "ranks" / "none_x").exists() and (trial / "trial.log").read_text() == ""
    (quiet.ranks_dir / "20260101120000_rank0.log").write_bytes(b"ok\n")
    quiet.stop()
    assert (trial / "trial.log").read_text() == "[rank 0] ok\n" and capsys.readouterr() == ("", "")
    single = OutputPump(tmp_path / "single", label=None, echo=True, fresh=True, echo_launcher=False)
    (single.ranks_dir / "20260101120000_rank1.log").write_bytes(b"hi\n")
    with single.launcher_file() as launcher:
        launcher.write(b"deepspeed: started\n")
    single.stop()
    assert capsys.readouterr() == ("[rank 1] hi\n", "") and single.last_lines() == ["[rank 1] hi"]
    across_hosts = OutputPump(tmp_path / "remote", label="trial 4", echo=False, fresh=True)
    with across_hosts.launcher_file() as launcher:   # pdsh, srun: the ranks' lines come through the launcher
        launcher.write(b"w1: Traceback\nw1: OSError: disk full\n")
    across_hosts.stop()
    assert across_hosts.last_lines() == ["[launcher] w1: Traceback", "[launcher] w1: OSError: disk full"]


def test_a_closed_console_stops_the_echo_not_the_log(tmp_path, monkeypatch):
    class Closed:
        def write(self, text):
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(sys, "stdout", Closed())
    pump = OutputPump(tmp_path, label="t", echo=True, fresh=True)
    (pump.ranks_dir / "1_rank0.log").write_bytes(b"a\n")
    pump.stop()
    assert (tmp_path / "trial.log").read_text() == "[rank 0] a\n" and pump.echo is False
