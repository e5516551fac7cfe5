"""Fails on its first run after a checkpoint, succeeds on the restart (toolkit.run's max_restarts):
the restart must see the checkpoint as latest_checkpoint and a new trial_run_id."""

import json
import logging
import os
import pathlib
import sys

from toolkit.compat import determined as det

logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
info = det.get_cluster_info()
with det.core.init() as core_context:
    if info.latest_checkpoint is None:
        with core_context.checkpoint.store_path({"steps_completed": 1}) as (path, storage_id):
            (path / "step").write_text("1")
        sys.exit(3)
    with core_context.checkpoint.restore_path(info.latest_checkpoint) as path:
        step = int((path / "step").read_text())
out = pathlib.Path(os.environ["TOOLKIT_OUTPUT_DIR"])
(out / "flaky.json").write_text(json.dumps({"step": step, "run": info.trial._trial_run_id}))
