"""One process, no launcher (`python det_single.py`): det.core.init() without a DistributedContext,
as in Determined's stage-1/2 tutorials; a SIGTERM to itself must turn should_preempt() True.
Prints one JSON line of what it saw; `invalid_hp` as argv[1] prints the latest checkpoint and the
trial id, then raises det.InvalidHP inside the context."""

import json
import logging
import os
import signal
import sys

from toolkit.compat import determined as det

logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
info = det.get_cluster_info()
seen = {"latest": info.latest_checkpoint, "trial_id": info.trial.trial_id}
with det.core.init() as core_context:
    if sys.argv[1:] == ["invalid_hp"]:
        print(json.dumps(seen), flush=True)
        raise det.InvalidHP("lr too large")
    seen["size"] = core_context.distributed.size
    seen["before"] = core_context.preempt.should_preempt()
    with core_context.checkpoint.store_path({"steps_completed": 1}) as (path, storage_id):
        (path / "x").write_text("1")
    seen["stored"] = storage_id
    core_context.train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
    os.kill(os.getpid(), signal.SIGTERM)
    seen["after"] = core_context.preempt.should_preempt()
    ops = list(op for op in core_context.searcher.operations() if op.report_completed(0.5) is None)
    seen["ops"] = [op.length for op in ops]
    seen["ops_again"] = len(list(core_context.searcher.operations()))
print(json.dumps(seen))
