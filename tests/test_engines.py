"""Real deepspeed.initialize + training steps on 2 gloo ranks with configs resolved by toolkit."""

import json
import math

from helpers import procutil


def test_zero_0_to_3_and_pipeline_train_with_resolved_configs(tmp_path):
    argv = procutil.torchrun_argv(procutil.WORKERS / "engine_worker.py", str(tmp_path))
    procutil.check(procutil.run(argv, timeout=600))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"engines_rank{rank}.json").read_text())
        for name, stage in [("zero0", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)]:
            r = report[name]
            assert r["stage"] == stage
            # build_ds_config derived accumulation 2 from 8 = 2 x gas x 2 ranks.
            assert (r["train_batch_size"], r["micro"], r["gas"], r["global_steps"]) == (8, 2, 2, 3)
            assert all(math.isfinite(v) for v in r["losses"])
        pipe = report["pipe"]
        # 2 pipeline stages on 2 ranks: data-parallel size 1, so accumulation is 4.
        assert (pipe["stage"], pipe["train_batch_size"], pipe["micro"], pipe["gas"], pipe["global_steps"]) == (1, 8, 2, 4, 3)
        assert all(math.isfinite(v) for v in pipe["losses"])
