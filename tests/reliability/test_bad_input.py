"""The bad-input table: every row is one wrong input, the entry point it reaches, the error it must give.

Each row asserts the error type; that the message names the key or flag AND the bad value (the
``fragments``); for the CLI, exit status 2; and that nothing was launched or written: the tree
under the test's directory is byte-for-byte the same afterwards, and ``subprocess.Popen`` (the
only way toolkit starts processes) raises if anything calls it. Everything runs in this process:
bad input must be refused before any process or collective is needed.

Entry points:
    yaml      toolkit.load_experiment_config(<file>)
    hparams   toolkit.get_hparams() inside a "trial" (TOOLKIT_TRIAL_HPARAMS=<file>) or with a path
    ds        toolkit.build_ds_config(hparams, data_parallel_size=2, ...) with ds_config.json
    cli       toolkit.dsat.tuner_cli.main(argv), the code of ``python -m toolkit.dsat``
    ckpt      toolkit.save_checkpoint / load_checkpoint argument checks, and the checkpoint
              directory decisions (toolkit.checkpoint.layout) that save/load apply to a directory
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

import toolkit
import toolkit.checkpoint.layout as layout
from helpers import procutil
from toolkit.errors import CheckpointError, ConfigError

CATEGORY = "bad input"
MODEL = procutil.WORKERS / "dsat_model_trial.py"
BASE_DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}


# ---------------------------------------------------------------------------------------- rows
def Y(text, frags, exc=ConfigError, id=None):
    return pytest.param("yaml", text, exc, frags, id=f"yaml-{id}")


def H(payload, frags, exc=ConfigError, id=None):
    return pytest.param("hparams", payload, exc, frags, id=f"hparams-{id}")


def D(payload, frags, exc=ConfigError, id=None):
    return pytest.param("ds", payload, exc, frags, id=f"ds-{id}")


def C(payload, frags, id=None):
    return pytest.param("cli", payload, SystemExit, frags, id=f"cli-{id}")


def K(payload, frags, exc=CheckpointError, id=None):
    return pytest.param("ckpt", payload, exc, frags, id=f"ckpt-{id}")


ROWS = [
    # ---- the experiment YAML
    Y("name: [unclosed\n", ["malformed YAML at line 2", "exp.yaml"], id="malformed"),
    Y("- a\n- b\n", ["got list", "['a', 'b']"], id="not-a-mapping"),
    Y("name: 5\n", ["name=5", "expected a string"], id="name-int"),
    Y("entrypoint: ''\n", ["entrypoint=''"], id="entrypoint-empty"),
    Y("entrypoint: 42\n", ["entrypoint=42", "got int"], id="entrypoint-int"),
    Y("entrypoint: [python3, '']\n", ["entrypoint=['python3', '']"], id="entrypoint-empty-part"),
    Y("resources: 3\n", ["resources=3"], id="resources-int"),
    Y("resources: {slots_per_trial: 0}\n", ["resources.slots_per_trial=0", ">= 1"], id="slots-zero"),
    Y("resources: {slots_per_trial: -2}\n", ["resources.slots_per_trial=-2"], id="slots-negative"),
    Y("resources: {slots_per_trial: two}\n", ["resources.slots_per_trial='two'"], id="slots-string"),
    Y("hyperparameters: [1, 2]\n", ["hyperparameters=[1, 2]"], id="hparams-list"),
    Y("hyperparameters: {lr: {type: double, minval: 0.1, maxval: 1}}\n", ["hyperparameters.lr", "'double'"],
      id="hparam-search-space"),
    Y("searcher: {max_length: 0}\n", ["searcher.max_length=0"], id="max-length-zero"),
    Y("searcher: {max_length: {epochs: 0}}\n", ["searcher.max_length={'epochs': 0}"], id="max-length-epochs"),
    Y("searcher: {smaller_is_better: 'yes'}\n", ["searcher.smaller_is_better='yes'"], id="smaller-string"),
    Y("searcher: {metric: ''}\n", ["searcher.metric=''"], id="metric-empty"),
    Y("checkpoint_storage: {save_trial_latest: -1}\n", ["checkpoint_storage.save_trial_latest=-1"],
      id="save-trial-latest-negative"),
    Y("checkpoint_storage: {storage_path: 5}\n", ["checkpoint_storage.storage_path=5"],
      id="storage-path-int"),
    Y("!!python/object/apply:os.system ['touch pwned']\n",
      ["python/object/apply:os.system", "malformed YAML"],
      id="python-tag-not-constructed"),
    Y(None, ["missing.yaml", "not found"], exc=FileNotFoundError, id="missing-file"),
    # bounded input (issue 30): toolkit.bounded_load refuses these before anything is built
    Y("".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "x"] * 10) + "]\n" for i in range(9))
      + "name: *l8\n", ["exp.yaml", "aliases", "expand to more than 200,000"], id="alias-bomb"),
    Y("hyperparameters: {lr: .nan}\n", ["exp.yaml", "'.nan' is not a finite number"], id="nan"),
    Y("hyperparameters: {lr: -.inf}\n", ["exp.yaml", "'-.inf' is not a finite number"], id="inf"),
    Y("entrypoint: python3 a.py\nentrypoint: python3 b.py\n", ["duplicate key 'entrypoint'", "lines 1 and 2"],
      id="duplicate-key"),
    Y(b"name: caf\xe9\n", ["exp.yaml", "not UTF-8", "0xe9", "offset 9"], id="latin-1"),
    Y("hyperparameters: " + "[" * 200 + "]" * 200 + "\n", ["exp.yaml", "nested deeper than 100"], id="deep"),
    Y("entrypoint: python3 'train.py\n", ["entrypoint=", "No closing quotation"], id="entrypoint-quote"),
    # ---- hyperparameters
    H({"trial_file": None}, ["TOOLKIT_TRIAL_HPARAMS=", "hparams.json", "file not found"],
      id="trial-file-missing"),
    H({"trial_file": "{'lr': 1}"}, ["TOOLKIT_TRIAL_HPARAMS=", "malformed JSON at line 1"],
      id="trial-file-malformed"),
    H({"trial_file": "[1, 2]"}, ["TOOLKIT_TRIAL_HPARAMS=", "expected a JSON object", "got list"],
      id="trial-file-list"),
    H({"trial_file": '{"lr": 1e999}'}, ["TOOLKIT_TRIAL_HPARAMS=", "1e999 is not a finite number"],
      id="trial-file-inf"),
    # ---- the DeepSpeed JSON and the hyperparameters that build it
    D({"json": '{"train_batch_size": 8,'}, ["malformed JSON at line 1", "ds_config.json"], id="malformed"),
    D({"json": '{"train_batch_size": 8, "train_batch_size": 16}'},
      ["duplicate key 'train_batch_size'", "8", "16"],
      id="duplicate-key"),
    D({"json": '{"train_batch_size": NaN}'}, ["NaN is not valid JSON", "ds_config.json"], id="nan"),
    D({"json": '{"train_batch_size": 1e999}'}, ["1e999 is not a finite number", "ds_config.json"], id="inf"),
    D({"json": '{"a": ' * 101 + "1" + "}" * 101}, ["nested deeper than 100", "ds_config.json"], id="deep"),
    D({"json": "[1, 2]"}, ["expected a JSON object at the top, got list"], id="top-list"),
    D({"hparams": {"deepspeed_config": "nope.json"}}, ["nope.json", "not found"], exc=FileNotFoundError,
      id="missing-file"),
    D({"hparams": {"deepspeed_config": 5}}, ["hyperparameters.deepspeed_config=5"], id="config-int"),
    D({"hparams": {"deepspeed_config": "ds_config.json", "overwrite_deepspeed_args": [1]}},
      ["hyperparameters.overwrite_deepspeed_args=[1]"], id="overwrite-list"),
    D({"hparams": {"lr": 0.1}}, ["no 'deepspeed_config' key", "found: lr"], id="no-deepspeed-keys"),
    D({"ds": {"train_micro_batch_size_per_gpu": 0}}, ["train_micro_batch_size_per_gpu=0"], id="mbs-zero"),
    D({"ds": {"train_micro_batch_size_per_gpu": -4}}, ["train_micro_batch_size_per_gpu=-4"],
      id="mbs-negative"),
    D({"ds": {"train_micro_batch_size_per_gpu": "8"}}, ["train_micro_batch_size_per_gpu='8'"],
      id="mbs-string"),
    D({"ds": {"gradient_accumulation_steps": 2.5}}, ["gradient_accumulation_steps=2.5"], id="gas-float"),
    D({"ds": {"train_batch_size": 10, "gradient_accumulation_steps": None}},
      ["train_batch_size=10", "train_micro_batch_size_per_gpu=4", "data_parallel_size=2"],
      id="tbs-not-divisible"),
    D({"ds": {"train_batch_size": 12, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 2}},
      ["batch sizes do not add up", "train_batch_size=12", "gradient_accumulation_steps=2"],
      id="triple-wrong"),
    D({"ds": {"train_batch_size": 7, "train_micro_batch_size_per_gpu": None,
              "gradient_accumulation_steps": None}},
      ["train_batch_size=7", "data_parallel_size=2"], id="tbs-odd-for-dp2"),
    D({"ds": {"zero_optimization": {"stage": 5}}}, ["zero_optimization.stage=5"], id="stage-5"),
    D({"ds": {"zero_optimization": {"stage": "one"}}}, ["zero_optimization.stage='one'"], id="stage-string"),
    D({"ds": {"zero_optimization": "yes"}}, ["zero_optimization='yes'"], id="zero-string"),
    D({"ds": {"zero_optimization": {"stage": 2}}, "pipeline": True},
      ["zero_optimization.stage=2", "pipeline"], id="pipeline-with-zero2"),
    D({"ds": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}},
      ["zero_optimization.offload_param.nvme_path is missing"], id="nvme-param-no-path"),
    D({"ds": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}},
      ["zero_optimization.offload_optimizer.ratio=0.5"], id="offload-ratio-stage2"),
    D({"ds": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}},
      ["zero_optimization.offload_optimizer.device='gpu'"], id="offload-device-unknown"),
    D({"ds": {"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}}},
      ["did you mean 'offload_optimizer'"], id="zero-key-typo"),
    D({"ds": {"fp16": {"enabled": True}, "bf16": {"enabled": True}}},
      ["fp16.enabled", "bf16.enabled", "true"],
      id="fp16-and-bf16"),
    D({"ds": {"amp": {"enabled": True}}}, ["amp", "Apex"], id="amp-removed"),
    D({"ds": {"gradient_clipping": "auto"}}, ["gradient_clipping='auto' is unresolved"], id="auto-unresolved"),
    D({"hparams_extra": {"global_batch_size": 64}},
      ["hyperparameters.global_batch_size=64", "train_batch_size"],
      id="global-batch-mismatch"),
    D({"dp": 0}, ["data_parallel_size=0"], id="dp-zero"),
    D({"ds": {"zero_optimization": {"stage": 2}}, "hidden_size": -1}, ["hidden_size=-1"],
      id="hidden-negative"),
    # ---- the dsat command line (exit status 2, nothing launched, no output directory)
    C({"flags": ["--max-trials", "1"]}, ["--max-trials", "1"], id="max-trials-1"),
    C({"flags": ["--max-trials", "-3"]}, ["--max-trials", "-3"], id="max-trials-negative"),
    C({"flags": ["--trial-timeout", "-5"]}, ["--trial-timeout", "-5"], id="timeout-negative"),
    C({"flags": ["--trial-timeout", "0"]}, ["--trial-timeout", "0"], id="timeout-zero"),
    C({"flags": ["--memory-per-slot", "3XB"]}, ["--memory-per-slot", "3XB"], id="memory-unit"),
    C({"flags": ["--zero-stages", "4"]}, ["--zero-stages", "'4'"], id="zero-stage-4"),
    C({"flags": ["--max-concurrent-trials", "0"]}, ["--max-concurrent-trials", "0"], id="concurrent-zero"),
    C({"flags": ["--metric", "speed"]}, ["--metric", "'speed'"], id="metric-unknown"),
    C({"method": "grid"}, ["invalid choice: 'grid'"], id="search-method-unknown"),
    C({"flags": ["--start-profile-step", "5", "--end-profile-step", "2"]},
      ["--end-profile-step=2", "--start-profile-step=5"], id="profile-steps-reversed"),
    C({"flags": ["--timed-window", "-3"]}, ["--timed-window", "-3"], id="timed-window-negative"),
    C({"flags": ["--max-slots", "1"], "slots": 2}, ["resources.slots_per_trial=2", "--max-slots=1"],
      id="slots-above-max-slots"),
    C({"flags": ["--resume"]}, ["--resume", "holds no search"], id="resume-nothing"),
    C({"previous_search": True}, ["--output-dir", "holds a previous search"], id="output-dir-taken"),
    C({"config": "missing.yaml"}, ["missing.yaml", "not found"], id="config-missing"),
    C({"model_dir": "nodir"}, ["MODEL_DIR", "nodir", "is not a directory"], id="model-dir-missing"),
    C({"entrypoint": "python3 missing.py"}, ["entrypoint", "missing.py not found"], id="entrypoint-missing"),
    C({"ds_text": '{"train_micro_batch_size_per_gpu": 4,'}, ["malformed JSON at line 1", "ds_config.json"],
      id="ds-malformed"),
    C({"ds": {"optimizer": {"type": "OneBitAdam", "params": {"lr": 0.001}}}}, ["optimizer.type='OneBitAdam'"],
      id="ds-optimizer-removed"),
    C({"ds_text": '{"train_micro_batch_size_per_gpu": 1e999}'},
      ["1e999 is not a finite number", "ds_config.json"], id="ds-inf"),
    C({"entrypoint": "python3 model.py '--x"}, ["entrypoint=", "No closing quotation"],
      id="entrypoint-quote"),
    C({"flags": ["--memory-per-slot", "9" * 400]}, ["--memory-per-slot", "not a size"], id="memory-huge"),
    C({"damaged_events": True, "flags": ["--resume"]}, ["events.jsonl", "line 2", "head -n 1"],
      id="resume-damaged-log"),
    C({"hparams": {"data_parallel_world_size": 3}}, ["hyperparameters.data_parallel_world_size=3"],
      id="dp-not-divisor"),
    # the user's DeepSpeed config as written, before dsat substitutes its micro-batch (issue 12 item 5)
    C({"ds": {"train_micro_batch_size_per_gpu": -2}}, ["train_micro_batch_size_per_gpu=-2"],
      id="ds-mbs-negative"),
    C({"ds": {"train_micro_batch_size_per_gpu": "4"}}, ["train_micro_batch_size_per_gpu='4'"],
      id="ds-mbs-string"),
    C({"ds": {"gradient_accumulation_steps": 0}}, ["gradient_accumulation_steps=0"], id="ds-gas-zero"),
    C({"ds": {"train_batch_size": -64}}, ["train_batch_size=-64"], id="ds-tbs-negative"),
    C({"ds": {"train_batch_size": 12, "gradient_accumulation_steps": 2}, "slots": 2},
      ["train_batch_size=12", "gradient_accumulation_steps=2"], id="ds-triple-wrong"),
    C({"ds": {"train_batch_size": 63, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto"}, "slots": 2},
      ["train_batch_size=63", "data_parallel_size=2"], id="ds-tbs-no-micro-batch-fits"),
    C({"ds": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}},
      ["zero_optimization.offload_optimizer.nvme_path is missing"], id="ds-nvme-no-path"),
    C({"ds": {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}},
      ["scheduler.params.total_num_steps is missing"], id="ds-scheduler-param-missing"),
    C({"hparams": {"hidden_size": -1}}, ["hyperparameters.hidden_size=-1"], id="hidden-size-negative"),
    C({"flags": ["--global-batch", "keep"]}, ["--global-batch keep", "train_batch_size"],
      id="global-batch-keep-unset"),
    C({"flags": ["--global-batch", "0"]}, ["--global-batch 0"], id="global-batch-zero"),
    C({"flags": ["--global-batch", "some"]}, ["--global-batch", "'some'"], id="global-batch-word"),
    C({"flags": ["--offload", "sometimes"]}, ["--offload", "'sometimes'"], id="offload-unknown"),
    C({"flags": ["--offload", "always", "--zero-stages", "1"]}, ["--offload=always", "stage 2 or 3"],
      id="offload-always-without-stage-2-3"),
    # ---- checkpoints: arguments and directories
    K({"call": "save", "kwargs": {"steps_completed": -1}}, ["steps_completed=-1"],
      exc=ConfigError, id="steps-negative"),
    K({"call": "save", "kwargs": {"steps_completed": 1, "tag": "../escape"}}, ["tag='../escape'"],
      exc=ConfigError, id="tag-escape"),
    K({"call": "save", "kwargs": {"steps_completed": 1, "tag": "/etc/passwd"}}, ["tag='/etc/passwd'"],
      exc=ConfigError, id="tag-absolute"),
    K({"call": "save", "kwargs": {"steps_completed": 1, "tag": "latest"}}, ["tag='latest'"],
      exc=ConfigError, id="tag-reserved"),
    K({"call": "save", "kwargs": {"steps_completed": 1, "run_id": "a/b"}}, ["run_id='a/b'"],
      exc=ConfigError, id="run-id-slash"),
    K({"call": "save", "kwargs": {"steps_completed": 1, "keep_last": 0}}, ["keep_last=0"],
      exc=ConfigError, id="keep-last-zero"),
    K({"call": "load", "kwargs": {"tag": ".."}}, ["tag='..'"], exc=ConfigError, id="load-tag-dotdot"),
    K({"call": "load", "file_as_dir": True}, ["checkpoint_dir=", "is not a directory"], id="dir-is-a-file"),
    K({"call": "other_run"}, ["run-a", "not of this run (run-b)", "overwrite=True"], id="dir-of-another-run"),
    K({"call": "uncommitted"}, ["tag 'step_3'", "toolkit_checkpoint.json", "interrupted"],
      id="load-uncommitted-tag"),
    K({"call": "damaged"}, ["toolkit_checkpoint.json", "damaged"], id="damaged-metadata"),
]


# ---------------------------------------------------------------------------------------- helpers
def _tree(root: Path) -> dict[str, str]:
    """Every file and directory under root with a hash of its content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def _model_dir(tmp_path: Path, payload: dict) -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    procutil.install_sim_model(MODEL, model_dir)
    ds = {**BASE_DS, **payload.get("ds", {})}
    (model_dir / "ds_config.json").write_text(payload.get("ds_text") or json.dumps(ds))
    config = {"name": "sim", "entrypoint": payload.get("entrypoint", "python3 model.py"),
              "resources": {"slots_per_trial": payload.get("slots", 1)}, "searcher": {"max_length": 10},
              "hyperparameters": {"deepspeed_config": "ds_config.json", **payload.get("hparams", {})}}
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump(config))
    if payload.get("damaged_events"):  # a start line, then one that is not a record
        (tmp_path / "out").mkdir()
        start = {"event": "start", "trial_id": 0, "observed_before": 0,
                 "spec": {"trial_id": 0, "micro_batch": 1, "zero": {"stage": 1}, "line": -1, "profile": True}}
        (tmp_path / "out" / "events.jsonl").write_text(json.dumps(start) + '\n{"event": "result"}\n'
                                                       + json.dumps(start) + "\n")
    if payload.get("previous_search"):
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "events.jsonl").write_text('{"event": "start"}\n')
    return model_dir


def _prepare(kind: str, payload, tmp_path: Path, monkeypatch):
    """Write the row's input files and return the call that must fail."""
    if kind == "yaml":
        if payload is None:
            return lambda: toolkit.load_experiment_config(tmp_path / "missing.yaml")
        if isinstance(payload, bytes):
            (tmp_path / "exp.yaml").write_bytes(payload)
        else:
            (tmp_path / "exp.yaml").write_text(payload)
        return lambda: toolkit.load_experiment_config(tmp_path / "exp.yaml")
    if kind == "hparams":
        monkeypatch.delenv(toolkit.EXPERIMENT_CONFIG_ENV, raising=False)
        if "trial_file" in payload:
            path = tmp_path / "hparams.json"
            if payload["trial_file"] is not None:
                path.write_text(payload["trial_file"])
            monkeypatch.setenv(toolkit.TRIAL_HPARAMS_ENV, str(path))
        else:
            monkeypatch.delenv(toolkit.TRIAL_HPARAMS_ENV, raising=False)
        return lambda: toolkit.get_hparams()
    if kind == "ds":
        ds = {**BASE_DS}
        for key, value in payload.get("ds", {}).items():
            if value is None:
                ds.pop(key, None)
            else:
                ds[key] = value
        (tmp_path / "ds_config.json").write_text(payload.get("json") or json.dumps(ds))
        hparams = payload.get("hparams", {"deepspeed_config": "ds_config.json"})
        hparams = {**hparams, **payload.get("hparams_extra", {})}
        return lambda: toolkit.build_ds_config(hparams, data_parallel_size=payload.get("dp", 2),
                                               base_dir=tmp_path,
                                               pipeline=payload.get("pipeline", False), device="cpu",
                                               hidden_size=payload.get("hidden_size"))
    if kind == "cli":
        from toolkit.dsat.tuner_cli import main

        model_dir = _model_dir(tmp_path, payload)
        config = tmp_path / payload["config"] if "config" in payload else model_dir / "deepspeed.yaml"
        target = tmp_path / payload["model_dir"] if "model_dir" in payload else model_dir
        argv = [payload.get("method", "binary"), str(config), str(target),
                "--output-dir", str(tmp_path / "out"),
                "--memory-per-slot", "100MiB", *payload.get("flags", [])]

        def call():
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse exits by itself on a malformed flag
                code = exit_.code
            raise SystemExit(code)
        return call
    # checkpoints
    root = tmp_path / "ckpt"
    what = payload["call"]
    if what == "save":
        return lambda: toolkit.save_checkpoint(object(), root, **payload["kwargs"])
    if what == "load":
        if payload.get("file_as_dir"):
            root.write_text("not a directory")
        return lambda: toolkit.load_checkpoint(object(), root, **payload.get("kwargs", {}))
    meta = {"tag": "step_2", "run_id": "run-a", "seq": 0, "steps_completed": 2, "world_size": 2}
    (root / "step_2").mkdir(parents=True)
    (root / "step_2" / layout.STARTED_FILE).write_text("{}")
    (root / "step_2" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (root / "step_2" / layout.COMMIT_FILE).write_text(json.dumps(meta) if what != "damaged" else '{"tag": ')
    (root / layout.RUN_FILE).write_text(json.dumps({"run_id": "run-a"}))
    (root / layout.LATEST_FILE).write_text("step_2")
    if what == "other_run":  # what save_checkpoint decides for a run that did not load from root
        return lambda: layout.plan_save(layout.scan_dir(root), tag="step_4", mine="run-b", overwrite=False)
    if what == "uncommitted":  # what load_checkpoint(tag="step_3") decides
        (root / "step_3").mkdir()
        (root / "step_3" / layout.STARTED_FILE).write_text("{}")
        return lambda: layout.resolve_tag(layout.scan_dir(root), "step_3")
    return lambda: layout.resolve_tag(layout.scan_dir(root), None)


def test_the_table_is_big_enough():
    kinds = [row.values[0] for row in ROWS]
    assert len(ROWS) >= 40 and all(kinds.count(k) >= 4 for k in ("yaml", "hparams", "ds", "cli", "ckpt"))
    assert len({row.id for row in ROWS}) == len(ROWS)


test_the_table_is_big_enough.uncounted = True  # a check of the table, not a bad input


@pytest.mark.parametrize("kind, payload, error, fragments", ROWS)
def test_bad_input(kind, payload, error, fragments, tmp_path, monkeypatch, capsys):
    call = _prepare(kind, payload, tmp_path, monkeypatch)
    launched = []

    def no_launch(*args, **kwargs):
        launched.append(args[0] if args else kwargs.get("args"))
        raise AssertionError(f"bad input launched a process: {launched[-1]}")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    capsys.readouterr()
    before = _tree(tmp_path)
    with pytest.raises(error) as caught:
        call()
    after = _tree(tmp_path)
    output = capsys.readouterr()
    message = str(caught.value) if kind != "cli" else output.out + output.err
    if kind == "cli":
        assert caught.value.code == 2, message[-2000:]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from the error:\n{message[-2000:]}"
    assert launched == []
    assert after == before, f"bad input wrote: {sorted(set(after.items()) ^ set(before.items()))}"
    assert not (tmp_path / "out" / "trials").exists() and not Path("pwned").exists()
