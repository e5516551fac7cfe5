"""toolkit's stand-in ``determined`` package (toolkit.compat.determined.shim): its launcher wrappers run
as ``python3 -m determined.launch.deepspeed|torch_distributed`` outside and inside a rank, and the
package's answers to imports it does not provide. In this process: the wrappers are run as
``__main__`` by their toolkit names, and a rank's exec is only reached with a command that cannot run
(a successful exec would replace the test process; the subprocess tests in
test_determined_launcher.py run real ones)."""

import importlib
import runpy

import pytest

from toolkit.compat.determined.shim.determined.launch import _in_rank

SHIM = "toolkit.compat.determined.shim.determined"


@pytest.fixture
def outside_a_rank(monkeypatch):
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("module", ["deepspeed", "torch_distributed"])
def test_a_wrapper_started_outside_a_rank_says_to_use_toolkit_run_and_exits_2(
        module, outside_a_rank, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [module, "python3", "train.py"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(f"{SHIM}.launch.{module}", run_name="__main__")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python3 -m determined.launch.{module}: error: this is toolkit's stand-in for "
                          "Determined's launcher")
    assert "run the experiment with 'python -m toolkit.run CONFIG MODEL_DIR'" in err


def test_a_wrapper_without_a_command_exits_2_naming_it(outside_a_rank, capsys):
    assert _in_rank.main("determined.launch.deepspeed", []) == 2
    assert capsys.readouterr().err.startswith("python3 -m determined.launch.deepspeed: error: ")


def test_in_a_rank_the_nproc_of_the_script_is_ignored_and_a_missing_command_is_127(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["--nproc_per_node", "4", "--", "/nonexistent/python3", "train.py"]
    assert _in_rank.main("determined.launch.torch_distributed", argv) == 127
    err = capsys.readouterr().err
    assert "warning: --nproc_per_node 4 is ignored inside a script: toolkit.run started 2 process(es) " \
           "per machine (resources.slots_per_trial)" in err
    assert "error: cannot run '/nonexistent/python3': [Errno 2] No such file or directory" in err


def test_the_shim_package_gives_launch_and_names_the_import_to_use_for_anything_else():
    det = importlib.import_module(SHIM)
    launch = importlib.import_module(f"{SHIM}.launch")
    # ``from determined import launch`` before the submodule was imported asks the package's __getattr__
    assert det.__getattr__("launch") is launch and det.launch is launch
    with pytest.raises(AttributeError, match="__wrapped__"):  # the import system's probes: no ImportError
        det.__getattr__("__wrapped__")
    with pytest.raises(ImportError, match=r"determined.core: this 'determined' is toolkit's shim.*"
                                          r"'from toolkit.compat import determined as det'"):
        det.__getattr__("core")
