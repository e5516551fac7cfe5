"""python -m toolkit.run's command line (toolkit.run.cli): bad flags, paths, YAML and records exit 2 naming
them with nothing started; a single trial goes to execute, a search to run_search, --slurm to the Slurm
engine, each with the flags given. In this process; the launches themselves are stubbed and recorded
(the real ones: test_process.py, test_scheduler.py, tests/cluster)."""

import json

import pytest

from toolkit.launch.trial_files import OPS_FILE, TRIAL_FILE
from toolkit.run import cli

SEARCH = {"entrypoint": "python3 x.py", "searcher": {"name": "random", "metric": "x", "max_trials": 2},
          "hyperparameters": {"n": {"type": "int", "minval": 1, "maxval": 4}}}


@pytest.fixture
def launches(monkeypatch):
    """What main would have started: (name, plan, keywords); nothing runs."""
    seen = []
    monkeypatch.setattr(cli, "execute", lambda plan, **kw: seen.append(("execute", plan, kw)) or 0)
    monkeypatch.setattr(cli, "run_search", lambda plan, **kw: seen.append(("run_search", plan, kw)) or 3)
    return seen


def _yaml(tmp_path, config):
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("flags, fragment", [
    (["--grace", "0"], "--grace=0.0: expected a number of seconds > 0"),
    (["--max-slots", "0"], "--max-slots=0: expected an integer >= 1"),
    (["--max-slots", "two"], "argument --max-slots: invalid int value: 'two'"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, launches, flags, fragment):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(_yaml(tmp_path, SEARCH)), str(tmp_path), *flags])
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err and launches == []


def test_bad_paths_and_yaml_exit_2_with_nothing_started(tmp_path, capsys, launches):
    with pytest.raises(SystemExit):
        cli.main([str(_yaml(tmp_path, SEARCH)), str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert "MODEL_DIR=" in err and "not a directory" in err
    assert cli.main([str(tmp_path / "none.yaml"), str(tmp_path)]) == 2
    assert "python -m toolkit.run: error:" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("entrypoint: [unclosed\n")
    assert cli.main([str(bad), str(tmp_path)]) == 2 and "malformed YAML" in capsys.readouterr().err
    assert cli.main([str(_yaml(tmp_path, dict(SEARCH, max_restarts=-1))), str(tmp_path)]) == 2
    assert "max_restarts=-1: expected an integer >= 0" in capsys.readouterr().err
    assert launches == [] and not (tmp_path / "runs").exists()


def test_a_single_trial_with_a_damaged_record_exits_2_before_its_launch(tmp_path, capsys, launches):
    yaml = _yaml(tmp_path, {"entrypoint": "python3 x.py"})
    out = tmp_path / "out"
    out.mkdir()
    (out / TRIAL_FILE).write_text(json.dumps({"trial_id": "seven", "experiment_id": 1}))
    assert cli.main([str(yaml), str(tmp_path), "--output-dir", str(out)]) == 2
    assert "trial_id='seven': expected integers" in capsys.readouterr().err
    (out / TRIAL_FILE).unlink()
    (out / OPS_FILE).write_text("{")
    assert cli.main([str(yaml), str(tmp_path), "--output-dir", str(out)]) == 2
    assert str(out / OPS_FILE) in capsys.readouterr().err and launches == []


def test_each_kind_of_run_goes_to_its_runner_with_the_flags(tmp_path, launches):
    single = _yaml(tmp_path, {"entrypoint": "python3 x.py"})
    assert cli.main([str(single), str(tmp_path), "--output-dir", str(tmp_path / "o"), "--grace", "7",
                     "--quiet"]) == 0
    (name, plan, kw), = launches
    assert (name, plan.output_dir, kw) == ("execute", (tmp_path / "o").resolve(),
                                           {"grace_s": 7.0, "echo": False})
    launches.clear()
    assert cli.main([str(_yaml(tmp_path, SEARCH)), str(tmp_path), "--max-slots", "2"]) == 3  # its status
    (name, plan, kw), = launches
    assert (name, kw) == ("run_search", {"grace_s": 60.0, "max_slots": 2, "echo": True})


def test_slurm_flag_problems_exit_2_before_any_submission(tmp_path, capsys, launches, monkeypatch):
    from toolkit.run import slurm_engine

    monkeypatch.setattr(slurm_engine, "_command", lambda argv: pytest.fail(f"ran {argv}"))
    single = _yaml(tmp_path, {"entrypoint": "python3 x.py"})
    assert cli.main([str(single), str(tmp_path), "--slurm", "--time=5"]) == 2
    assert "--slurm: runs a search's trials as Slurm jobs, and searcher.name is 'single'" in \
        capsys.readouterr().err
    assert cli.main([str(_yaml(tmp_path, SEARCH)), str(tmp_path), "--slurm", "", "--max-slots", "2"]) == 2
    assert "--max-slots=2: the slots of this machine, which --slurm does not use" in capsys.readouterr().err
    assert launches == []


def test_a_record_that_cannot_be_read_exits_2_naming_it(tmp_path, capsys, launches):
    out = tmp_path / "out"
    (out / OPS_FILE).mkdir(parents=True)  # a directory where the record should be: reading it fails
    assert cli.main([str(_yaml(tmp_path, {"entrypoint": "python3 x.py"})), str(tmp_path),
                     "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out}: a record cannot be read (" in err and OPS_FILE in err and launches == []
