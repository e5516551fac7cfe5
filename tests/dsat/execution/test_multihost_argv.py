"""toolkit.dsat.execution.multihost_argv: the remote line for pdsh, and the pdsh runner that uses it
(issue 30); the flag that names a trial's own DeepSpeed config in the entrypoint (the last test).

Pure checks of the words, plus the line itself run by the real ``bash -c`` and ``sh -c`` as the
remote login shell would after pdsh's ``%`` substitution (which :func:`pdsh_substitute` mimics:
pdsh 2.34 replaces ``%n``, ``%h``, ``%u`` and ``%%`` anywhere in the line, quotes or not; the
real pdsh runs it in tests/cluster/test_pdsh_quoting.py).
"""

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from toolkit.dsat.execution.multihost_argv import (
    PDSH_RUNNER_MODULE,
    build_multihost_argv,
    build_remote_kill_argv,
    config_flag,
    pdsh_remote_command,
    with_config_flag,
)

PY = sys.executable
NASTY = ["--note=a;touch${IFS}X", "$(touch Y)", "`touch Z`", "; touch V", "two words", "it's \"quoted\"",
         "100%h %n %%", "x\ntouch W", "*", "~", "a|b&c>d<e", "back\\slash", "-", "é ü", "$HOME", "!!"]
PRINT_ARGV = "import json, os, sys; print(json.dumps([sys.argv[1:], os.getcwd(), os.environ.get('V')]))"


def pdsh_substitute(line: str, rank: int = 0) -> str:
    values = {"n": str(rank), "h": "host", "u": "root", "%": "%"}
    return re.sub(r"%([nhu%])", lambda m: values[m.group(1)], line)


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_the_remote_line_gives_the_script_its_words_exactly(tmp_path, shell):
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell}")
    markers = tmp_path / "markers"
    markers.mkdir()
    cwd = tmp_path / "model dir;$(touch cwd) `touch cwd2` 50%n"
    cwd.mkdir()
    value = "v;$(touch value)`touch value2` 'q' \"d\" %h"
    line = pdsh_remote_command([PY, "-c", PRINT_ARGV], ["train.py", *NASTY], cwd=str(cwd),
                               exports={"V": value})
    done = subprocess.run([shell, "-c", pdsh_substitute(line, rank=3)], cwd=markers, capture_output=True,
                          text=True, timeout=60, check=True)
    argv, seen_cwd, seen_value = json.loads(done.stdout)
    assert argv == ["--node_rank=3", "train.py", *NASTY]
    assert (seen_cwd, seen_value) == (str(cwd), value)
    assert list(markers.iterdir()) == [] and list(cwd.iterdir()) == []


def test_the_remote_line_word_by_word():
    line = pdsh_remote_command(["python", "-m", "launch"], ["t.py", "a;b"], cwd="/m d", exports={"A": "1 2"},
                               source="/v env/activate")
    assert shlex.split(pdsh_substitute(line)) == [
        ".", "/v env/activate", "&&", "cd", "--", "/m d", "&&", "export", "A=1 2", "&&",
        "exec", "python", "-m", "launch", "--node_rank=0", "t.py", "a;b"]
    with pytest.raises(ValueError, match=r"exported variable name\(s\) \['A;B'\]"):
        pdsh_remote_command(["python"], ["t.py"], cwd="/", exports={"A;B": "1"})
    with pytest.raises(ValueError, match="expected non-empty lists"):
        pdsh_remote_command(["python"], [], cwd="/")


def test_pdsh_trials_go_through_the_quoting_runner_the_mpi_ones_through_deepspeeds():
    placement = {"w0": (0, 1), "w1": (0,)}
    pdsh = build_multihost_argv(["python3", "t.py"], placement=placement, via="pdsh", master_port=1,
                                hostfile="h")
    mpi = build_multihost_argv(["python3", "t.py"], placement=placement, via="openmpi", master_port=1,
                               hostfile="h")
    assert pdsh[:3] == [PY, "-m", PDSH_RUNNER_MODULE] and mpi[:3] == [PY, "-m", "deepspeed.launcher.runner"]
    assert pdsh[3:] == ["--hostfile", "h", "--include", "w0:0,1@w1:0", "--master_addr", "w0", "--master_port",
                        "1", "--launcher", "pdsh", "--force_multi", "--no_local_rank", "t.py"]


def test_the_quoting_runner_builds_pdsh_argv_from_our_argv(tmp_path, monkeypatch):
    """DeepSpeed's parser reads the trial's argv; the quoting runner's command runs nothing of the
    arguments, variables or directory (nothing is started: the pdsh line is checked word by word)."""
    from deepspeed.launcher.runner import (
        encode_world_info,
        fetch_hostfile,
        parse_args,
        parse_inclusion_exclusion,
    )

    from toolkit.dsat.execution.pdsh_launch import QuotedPDSHRunner

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0 slots=2\nw1 slots=1\n")
    cwd = tmp_path / "a b;$(c)"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv = build_multihost_argv(["python3", "train.py", *NASTY], placement={"w0": (0, 1), "w1": (0,)},
                                via="pdsh", master_port=29512, hostfile=hostfile, ssh_port=2222)
    args = parse_args(argv[3:])
    active = parse_inclusion_exclusion(fetch_hostfile(args.hostfile), args.include, args.exclude)
    runner = QuotedPDSHRunner(args, encode_world_info(active))
    runner.add_export("TOOLKIT_DSAT_TRIAL", "/o $(x)/trial.json\n")  # as read from DS_ENV_FILE
    cmd, kill, env = runner.get_cmd({"PDSH_SSH_ARGS_APPEND": "-q"}, active)
    assert cmd[:-1] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1"]
    assert env["PDSH_RCMD_TYPE"] == "ssh" and env["PDSH_SSH_ARGS_APPEND"] == "-q -p 2222"
    words = shlex.split(pdsh_substitute(cmd[-1], rank=1))
    assert words[:7] == ["cd", "--", str(cwd), "&&", "export", "TOOLKIT_DSAT_TRIAL=/o $(x)/trial.json", "&&"]
    assert words[7:11] == ["exec", PY, "-u", "-m"] and words[11] == "deepspeed.launcher.launch"
    rank = words.index("--node_rank=1")
    assert "--no_local_rank" in words[12:rank] and words[rank + 1:] == ["train.py", *NASTY]
    assert kill == build_remote_kill_argv(["w0", "w1"], master_port=29512)


# --deepspeed_config and HF's --deepspeed name each trial's own config file (DeepSpeed's autotuner's rule
# for --deepspeed: a value naming a .json; alone it is DeepSpeed's switch from add_config_arguments)
T = "/out/trials/trial_3/ds_config.json"


@pytest.mark.parametrize("entrypoint, flag, rewritten", [
    (["python3", "train.py", "--deepspeed", "--deepspeed_config", "ds.json", "--lr", "1"],
     ("--deepspeed_config", "ds.json"),
     ["python3", "train.py", "--deepspeed", "--deepspeed_config", T, "--lr", "1"]),
    (["deepspeed", "--num_gpus", "2", "train.py", "--deepspeed_config=cfg/ds.json"],
     ("--deepspeed_config", "cfg/ds.json"),
     ["deepspeed", "--num_gpus", "2", "train.py", f"--deepspeed_config={T}"]),
    (["python3", "run_clm.py", "--deepspeed", "ds_z2.json", "--do_train"],
     ("--deepspeed", "ds_z2.json"), ["python3", "run_clm.py", "--deepspeed", T, "--do_train"]),
    (["python3", "run_clm.py", "--deepspeed=ds_z2.json"], ("--deepspeed", "ds_z2.json"),
     ["python3", "run_clm.py", f"--deepspeed={T}"]),
    # none: DeepSpeed's bare switch, a value that names no JSON, a flag with no value, nothing
    (["python3", "train.py", "--deepspeed", "--epochs", "3"], None, None),
    (["python3", "train.py", "--deepspeed", "stage2"], None, None),
    (["python3", "train.py", "--deepspeed_config"], None, None),
    (["python3", "train.py"], None, None),
])
def test_the_config_flag_names_the_trials_own_file(entrypoint, flag, rewritten):
    assert config_flag(entrypoint) == flag
    assert with_config_flag(entrypoint, T) == (rewritten or entrypoint)
    # both flags: the first is the convention, both name the trial's file
    both = ["python3", "t.py", "--deepspeed_config", "a.json", "--deepspeed", "b.json"]
    assert config_flag(both) == ("--deepspeed_config", "a.json")
    assert with_config_flag(both, T) == ["python3", "t.py", "--deepspeed_config", T, "--deepspeed", T]


@pytest.mark.parametrize("hosts, port, words", [
    ("w0", 29500, "hosts='w0': expected a non-empty list of host names"),
    ([], 29500, "hosts=[]: expected a non-empty list"),
    (["w0", ""], 29500, "hosts=['w0', '']: expected"),
    (["w0"], 0, "master_port=0: expected an integer port in 1..65535"),
    (["w0"], "29500", "master_port='29500': expected an integer port"),
])
def test_the_remote_kill_rejects_bad_hosts_and_ports(hosts, port, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        build_remote_kill_argv(hosts, master_port=port)
