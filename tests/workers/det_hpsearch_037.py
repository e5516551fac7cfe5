"""One-rank Core API script in the style of Determined 0.37's 3_hpsearch.py tutorial (imports swapped,
the loop as written there): it trains `while batch < op.length` for each searcher operation, reports
progress, validates and `op.report_completed(x)` at the end of each, checkpoints, and raises
det.InvalidHP for increment_by 8. It writes get_experiment_best_validation() as it starts to best.json."""

import json
import logging
import os
import pathlib
import time

from toolkit.compat import determined as det

logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
info = det.get_cluster_info()
increment_by = info.trial.hparams["increment_by"]
out = pathlib.Path(os.environ["TOOLKIT_OUTPUT_DIR"])


def save(core_context, x, steps_completed):
    with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (path, _):
        (path / "state").write_text(json.dumps([x, steps_completed]))


def main(core_context):
    (out / "best.json").write_text(json.dumps(core_context.train.get_experiment_best_validation()))
    if increment_by == 8:
        raise det.InvalidHP(f"increment_by={increment_by} is too large")
    x, batch = 0, 0
    if info.latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(info.latest_checkpoint) as path:
            x, batch = json.loads((pathlib.Path(path) / "state").read_text())
    steps_completed = batch
    for op in core_context.searcher.operations():
        while batch < op.length:
            x += increment_by
            steps_completed = batch + 1
            time.sleep(0.02)
            core_context.train.report_training_metrics(steps_completed=steps_completed, metrics={"x": x})
            op.report_progress(steps_completed)
            batch += 1
            if core_context.preempt.should_preempt():
                return save(core_context, x, steps_completed)
        core_context.train.report_validation_metrics(steps_completed=steps_completed, metrics={"x": x})
        op.report_completed(x)
    save(core_context, x, steps_completed)


with det.core.init() as core_context:
    main(core_context)
