"""Two-rank worker for tests/test_metrics.py: every rank reports rank-dependent metrics.

    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT \\
        tests/workers/metrics_worker.py LOG_DIR OUT_DIR

Writes OUT_DIR/rank<N>.json with what the test checks besides the files in LOG_DIR: the number
of collectives each report made, the values each report returned and the errors raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import toolkit.metrics.writer as metrics_module
from toolkit.metrics.writer import MetricsWriter
from toolkit.runtime.context import init_distributed

# Count the collectives toolkit issues (it calls them as attributes of torch.distributed).
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                "gather_object", "barrier", "reduce", "all_gather_into_tensor", "scatter_object_list")
calls = {"n": 0}


def _counting(fn):
    def wrapper(*args, **kwargs):
        calls["n"] += 1
        return fn(*args, **kwargs)
    return wrapper


for _name in _COLLECTIVES:
    setattr(dist, _name, _counting(getattr(dist, _name)))

# A fake clock, so samples_per_second has an exact expected value: each report call advances
# rank r's clock by r + 1 seconds (rank 0: 1 s, rank 1: 2 s; mean 1.5 s).
clock = {"now": 0.0}
metrics_module._monotonic = lambda: clock["now"]


def main() -> None:
    log_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    ctx = init_distributed()
    r = ctx.rank
    record: dict = {"rank": r, "world_size": ctx.world_size, "collectives": [], "returned": [],
                    "errors": {}}

    def report(kind: str, *args, **kwargs):
        clock["now"] += r + 1
        before = calls["n"]
        method = getattr(writer, f"report_{kind}_metrics")
        result = method(*args, **kwargs)
        record["collectives"].append([kind, args[0], calls["n"] - before])
        record["returned"].append([kind, args[0], result])
        return result

    def expect_error(label: str, *args, **kwargs):
        clock["now"] += r + 1
        try:
            writer.report_training_metrics(*args, **kwargs)
        except ValueError as err:
            record["errors"][label] = str(err)
        else:
            record["errors"][label] = None

    # reduce_every=1: every report is its own collective, so each call's behaviour shows alone.
    writer = MetricsWriter(ctx, log_dir, flush_every=3, reduce_every=1)
    with writer:
        for step in (2, 4, 6, 8):
            report("training", step,
                   {"loss": torch.tensor(float(step + r)),     # mean step + 0.5
                    "acc": np.float32(0.25 * r),               # mean 0.125
                    "count": r + 1},                           # mean 1.5
                   samples=10 * (r + 1),                       # 30 in all per report
                   batch_metrics=[{"batch_loss": s + 100.0 * r} for s in (step - 1, step)])
            if step in (4, 8):
                report("validation", step, {"val_loss": torch.tensor([1.0 + r])})  # mean 1.5

        # Rank 0 passes the agreed names, rank 1 fewer: the vectors would differ in length.
        if r == 0:
            expect_error("names", 9, {"loss": 1.0, "acc": 1.0, "count": 1}, samples=1,
                         batch_metrics=[{"batch_loss": 1.0}, {"batch_loss": 1.0}])
        else:
            expect_error("names", 9, {"loss": 1.0})
        expect_error("steps", 9 + r, {"loss": 1.0, "acc": 1.0, "count": 1}, samples=1,
                     batch_metrics=[{"batch_loss": 1.0}, {"batch_loss": 1.0}])
        # Still usable after both errors, and a new set of names is agreed on again.
        report("training", 10, {"loss": 3.0 * r})                # mean 1.5

    # The default batching: one collective per reduce_every training reports; validation and
    # close() average what is pending; names that disagree inside a batch still raise on all ranks.
    batched: list = []
    with MetricsWriter(ctx, log_dir.parent / "batched", reduce_every=4) as bw:
        for step in range(1, 10):
            before = calls["n"]
            out = bw.report_training_metrics(step, {"loss": float(step + r)})  # mean step + 0.5
            batched.append(["training", step, calls["n"] - before, out])
        before = calls["n"]
        out = bw.report_validation_metrics(9, {"val": float(r)})            # mean 0.5, + pending 9
        batched.append(["validation", 9, calls["n"] - before, out])
        for step in (10, 11):
            bw.report_training_metrics(step, {"loss": float(step + r)})
        before = calls["n"]
    batched.append(["close", 11, calls["n"] - before, None])
    with MetricsWriter(ctx, log_dir.parent / "batched_bad", reduce_every=2) as bad:
        bad.report_training_metrics(1, {"loss": 1.0})
        try:  # the second report completes the batch: rank 1 passes other names
            bad.report_training_metrics(2, {"loss": 1.0} if r == 0 else {"other": 1.0})
        except ValueError as err:
            record["errors"]["batched_names"] = str(err)
        else:
            record["errors"]["batched_names"] = None
    record["batched"] = batched

    # Files only on the chief: give each rank its own directory and see which ones appear.
    with MetricsWriter(ctx, log_dir.parent / f"per_rank_{r}") as own:
        own.report_validation_metrics(0, {"x": float(r)})

    (out_dir / f"rank{r}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
