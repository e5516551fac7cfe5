"""One-rank Core API script in the style of Determined's 3_hpsearch.py tutorial (imports swapped only):
x grows by the trial's `increment_by` each step; every `report_every` steps it reports validation
metrics {x, batches}, checkpoints, and stops when should_preempt() (a pause, or the searcher's early
stop). Resumes from latest_checkpoint. DET_TEST_STEP_SLEEP: seconds per step (default 0.05);
DET_TEST_SLOW=DIR:STEP:SECONDS: in the trial whose output directory is named DIR, the steps after
STEP take SECONDS each (so that the searcher's stop lands before the trial could end by itself)."""

import json
import logging
import os
import pathlib
import time

from toolkit.compat import determined as det

logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
info = det.get_cluster_info()
hparams, sleep = info.trial.hparams, float(os.environ.get("DET_TEST_STEP_SLEEP", "0.05"))
slow_dir, slow_after, slow_sleep = (os.environ.get("DET_TEST_SLOW") or "-:0:0").split(":")
if pathlib.Path(os.environ["TOOLKIT_OUTPUT_DIR"]).name != slow_dir:
    slow_after = str(1 << 30)
with det.core.init() as core_context:
    x, start = 0, 0
    if info.latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(info.latest_checkpoint) as path:
            x, start = json.loads((pathlib.Path(path) / "state").read_text())
    for batch in range(start, hparams["max_length"]):
        x += hparams["increment_by"]
        steps_completed = batch + 1
        time.sleep(float(slow_sleep) if batch >= int(slow_after) else sleep)
        if steps_completed % hparams["report_every"] == 0:
            core_context.train.report_validation_metrics(
                steps_completed=steps_completed, metrics={"x": x, "batches": steps_completed}
            )
            with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (path, _):
                (path / "state").write_text(json.dumps([x, steps_completed]))
            if core_context.preempt.should_preempt():
                break
