"""The examples/core_api scripts shrunk to run in seconds: their own configs with small sizes."""

import yaml

from helpers import procutil

EXAMPLES = procutil.REPO / "examples" / "core_api"

# Small versions of the examples' own configs, so each run takes seconds.
SMALL = {
    "train.py": ("deepspeed.yaml", {"dataset_size": 512, "image_size": 16, "width": 8, "validate_every": 5,
                                    "checkpoint_every": 5}),
    "pipeline.py": ("pipeline.yaml", {"dataset_size": 512, "image_size": 16, "width": 8, "validate_every": 5,
                                      "checkpoint_every": 5}),
    "mlm.py": ("mlm.yaml", {"dataset_size": 1024, "d_model": 32, "validate_every": 5, "checkpoint_every": 5}),
    "causal_lm.py": ("causal_lm.yaml", {"dataset_size": 1024, "d_model": 32, "seq_len": 32,
                                        "validate_every": 5, "checkpoint_every": 5}),
}


# DeepSpeed's default ZeRO buckets (5e8 elements) make it allocate 2 GB on every backward pass; on
# CPU that dominates these tiny models' steps (measured: mlm.py 40 steps 101 s -> 22 s, train.py
# 78 s -> 12 s on 2 busy cores).
SMALL_BUCKETS = {"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}


def small_config(tmp_path, script, **hparams):
    name, overrides = SMALL[script]
    config = yaml.safe_load((EXAMPLES / name).read_text())
    config["hyperparameters"].update(overrides, **hparams)
    ds_overrides = config["hyperparameters"].setdefault("overwrite_deepspeed_args", {})
    ds_overrides["zero_optimization"] = {**ds_overrides.get("zero_optimization", {}), **SMALL_BUCKETS}
    config["hyperparameters"]["deepspeed_config"] = str(EXAMPLES / "ds_config.json")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path
