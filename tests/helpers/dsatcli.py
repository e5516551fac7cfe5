"""dsat's command line on the simulated model (tests/workers/dsat_model_trial.py): a model
directory, the CLI as a process or in this process, and the trials.csv it writes."""

import csv
import json
import sys

import yaml

from helpers import procutil

MODEL = procutil.WORKERS / "dsat_model_trial.py"


def make_model_dir(tmp_path, *, slots=1, hparams=None, ds=None, experiment=None):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    procutil.install_sim_model(MODEL, model_dir)
    (model_dir / "ds_config.json").write_text(json.dumps(ds or {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
        "flops_profiler": {"enabled": False}}))
    config = {"name": "sim", "entrypoint": "python3 model.py", "resources": {"slots_per_trial": slots},
              "searcher": {"max_length": 10},
              "hyperparameters": {"deepspeed_config": "ds_config.json", "oom_above": 37, **(hparams or {})}}
    config.update(experiment or {})
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump(config))
    return model_dir


def dsat(model_dir, *flags, method="binary", output=None, timeout=300):
    # No re-runs of the best unless a test asks (--confirm): each search here stays as short as it was;
    # test_binary_search_finds_the_limit_and_writes_everything confirms its best.
    confirm = () if "--confirm" in flags else ("--confirm", "0")
    argv = [sys.executable, "-m", "toolkit.dsat", method, str(model_dir / "deepspeed.yaml"), str(model_dir),
            "--output-dir", str(output or model_dir.parent / "out"), "--trial-timeout", "60", *flags,
            *confirm]
    return procutil.run(argv, timeout=timeout)


def dsat_in_process(model_dir, *flags, method="binary", capsys):
    """The CLI in this process (bad input never launches anything, so no subprocess is needed)."""
    from toolkit.dsat.tuner_cli import main

    argv = [
        method,
        str(model_dir / "deepspeed.yaml"),
        str(model_dir),
        "--output-dir",
        str(model_dir.parent / "out"),
        "--trial-timeout",
        "60",
        *flags,
    ]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own exit on a bad flag
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def trial_rows(out):
    with open(out / "trials.csv") as fh:
        return list(csv.DictReader(fh))


def plan_for(tmp_path, model_dir, *flags, method="binary"):
    from toolkit.dsat.tuner_cli import build_parser, make_plan

    args = build_parser().parse_args([method, str(model_dir / "deepspeed.yaml"), str(model_dir),
                                      "--output-dir", str(tmp_path / "out"), "--memory-per-slot", "100MiB",
                                      *flags])
    return make_plan(args)  # checks and plans only: launches and writes nothing


KEEP_64 = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
