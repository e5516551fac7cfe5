"""One run's launch (toolkit.run.process), pure parts: the GPUs DeepSpeed's launcher is given."""

import base64
import json

from toolkit.run import plan_run
from toolkit.run.process import _launch_argv, deepspeed_include


def _plan(tmp_path, entrypoint, slots=2):
    return plan_run({"entrypoint": entrypoint, "resources": {"slots_per_trial": slots}},
                    config_path=tmp_path / "x.yaml", model_dir=tmp_path, output_dir=tmp_path)


def test_deepspeed_launches_on_the_gpus_the_run_was_given(tmp_path):
    ds = _plan(tmp_path, "python3 -m determined.launch.deepspeed python3 train.py")
    assert deepspeed_include(ds, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == "localhost:4,5"  # the first nproc
    argv = _launch_argv(ds, 29511, {"CUDA_VISIBLE_DEVICES": "1,3"})
    info = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    assert json.loads(base64.urlsafe_b64decode(info)) == {"localhost": [1, 3]}
    for env in ({}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"},
                {"CUDA_VISIBLE_DEVICES": "0,0"}):
        assert deepspeed_include(ds, env) is None, env  # the launcher's default slots 0..n-1
    assert deepspeed_include(_plan(tmp_path, "python3 train.py"), {"CUDA_VISIBLE_DEVICES": "1,3"}) is None
