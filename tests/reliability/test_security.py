"""The security notes (docs/security.md), tested where they can be.

* YAML is loaded safely: a Python-object tag is an error and constructs nothing.
* No shell: no ``shell=True``, ``os.system``, ``os.popen``, ``subprocess.getoutput`` or
  ``eval``/``exec`` anywhere in toolkit, the examples or the scripts (read from the source with
  ``ast``, so a new call fails this test); an ``entrypoint`` string with shell syntax becomes
  inert argv words.
* Names from users (tags, run ids) cannot leave their directory: every accepted name, fuzzed,
  resolves to a direct child of the checkpoint directory; dsat trial directories are numbered.
* What is unpickled: every ``torch.load`` in toolkit passes ``weights_only=True`` except the one
  documented place that reads DeepSpeed's own file (consolidate, ZeRO-0), and a malicious pickle
  in a toolkit file (a rank's RNG states) is refused, not run.
"""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import toolkit
import toolkit.checkpoint.layout as layout
from helpers import procutil
from toolkit.config.experiment import entrypoint_argv
from toolkit.errors import CheckpointError, ConfigError

CATEGORY = "security"
SOURCES = sorted([*(procutil.REPO / "toolkit").rglob("*.py"), *(procutil.REPO / "examples").rglob("*.py"),
                  *(procutil.REPO / "scripts").glob("*.py")])


def _calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else "?"


def test_yaml_python_tags_construct_nothing(tmp_path):
    marker = tmp_path / "pwned"
    config = tmp_path / "exp.yaml"
    config.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="python/object/apply:os.system"):
        toolkit.load_experiment_config(config)
    assert not marker.exists()


def test_no_shell_anywhere_in_the_sources():
    assert len(SOURCES) > 20, SOURCES  # the scan really reads the package
    offences = []
    for path in SOURCES:
        for call in _calls(path):
            name = _name(call.func)
            if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput", "eval",
                        "exec", "yaml.load", "yaml.unsafe_load", "pickle.load", "pickle.loads"):
                offences.append(f"{path.relative_to(procutil.REPO)}:{call.lineno} {name}()")
            for keyword in call.keywords:
                if keyword.arg == "shell" and not (isinstance(keyword.value, ast.Constant) and not keyword.value.value):
                    offences.append(f"{path.relative_to(procutil.REPO)}:{call.lineno} {name}(shell=...)")
    assert offences == []


def test_an_entrypoint_with_shell_syntax_stays_inert_words():
    argv = entrypoint_argv({"entrypoint": "python3 train.py; rm -rf / $(touch pwned) `id` | cat"})
    assert argv[:2] == ["python3", "train.py;"] and "$(touch" in argv and "|" in argv
    from toolkit.launch.argv import build_trial_argv

    # The trial launcher passes the words on as separate argv items, never as one command string.
    for launcher in ("torchrun", "deepspeed"):
        launch = build_trial_argv(argv, launcher=launcher, nproc=2, master_port=29500)
        assert all(isinstance(word, str) for word in launch)
        assert launch[-len(argv) + 1:] == argv[1:], launch


def test_every_torch_load_is_weights_only_but_the_documented_one():
    loose = []
    for path in sorted((procutil.REPO / "toolkit").rglob("*.py")):
        for call in _calls(path):
            if _name(call.func) != "torch.load":
                continue
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in call.keywords)
            if not safe:
                loose.append(f"{path.relative_to(procutil.REPO)}:{call.lineno}")
    # consolidate_checkpoint reads DeepSpeed's ZeRO-0 model file, which pickles more than tensors;
    # it is documented as "trusted checkpoints only" in its docstring and in the module's Trust note.
    assert len(loose) == 1 and loose[0].startswith("toolkit/checkpoint/consolidate.py"), loose
    source = (procutil.REPO / "toolkit" / "checkpoint" / "consolidate.py").read_text()
    assert "trusted" in source and "weights_only=False" in source


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch " + str(_Evil.marker),))


def test_a_malicious_pickle_in_a_toolkit_file_is_refused_not_run(tmp_path):
    _Evil.marker = tmp_path / "pwned"
    path = tmp_path / layout.RNG_DIR / "rank_00000.pt"
    path.parent.mkdir()
    torch.save({"rank": 0, "world_size": 1, "rng": _Evil()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, map_location="cpu", weights_only=True)  # exactly how load_checkpoint reads it
    assert not _Evil.marker.exists()


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=30))
def test_no_accepted_tag_or_run_id_leaves_its_directory(tmp_path_factory, name):
    root = Path("/ckpt/root")
    for what in ("tag", "run_id"):
        try:
            accepted = layout.validate_name(name, what=what)
        except CheckpointError as err:
            assert f"{what}={name!r}" in str(err)
            continue
        target = Path(os.path.normpath(root / accepted))
        assert target.parent == root and target.name == accepted and not accepted.startswith(".")


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "/abs", ".hidden", "a\\b", "a\0b", "", "latest",
                                  "toolkit_run.json", "x" * 201, "step\n1"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(CheckpointError):
        layout.validate_name(name)


def test_dsat_trial_directories_are_numbered_not_named_by_users():
    source = (procutil.REPO / "toolkit" / "dsat" / "execution" / "runner.py").read_text()
    assert 'f"trial_{' in source  # trial_<int id>: no user string reaches a trial's path
