"""A Core API script that is its own launcher, in the style of Determined's 4_distributed.py tutorial
(imports swapped only): `det_launcher.py launcher` starts one `python3 -m determined.launch.wrap_rank
RANK -- python3 det_launcher.py worker RANK LOCAL_RANK` per slot of its container, from
len(info.slot_ids), len(info.container_addrs), info.container_rank and container_addrs[0]; each worker
builds det.core.DistributedContext by hand, allgathers every step, the chief checkpoints every
`checkpoint_every` steps, and every worker stops on should_preempt(). Writes <out>/preempted-<rank>
(the step) when preempted and <out>/final.json (x, trial id, hparams) at the end.
DET_TEST_STEP_SLEEP: seconds per step (default 0.05)."""

import json
import logging
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time

from toolkit.compat import determined as det

SLEEP = float(os.environ.get("DET_TEST_STEP_SLEEP", "0.05"))


def main(core_context, latest_checkpoint, trial_id, hparams, out):
    x, start = 0, 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            x, start, ckpt_trial = json.loads((pathlib.Path(path) / "state").read_text())
            assert ckpt_trial == trial_id
    for batch in range(start, hparams["max_length"]):
        x += sum(core_context.distributed.allgather(hparams["increment_by"]))
        steps_completed = batch + 1
        time.sleep(SLEEP)
        if steps_completed % hparams["checkpoint_every"] == 0:
            if core_context.distributed.rank == 0:
                core_context.train.report_validation_metrics(steps_completed=steps_completed,
                                                             metrics={"x": x})
                with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (path, _):
                    (path / "state").write_text(json.dumps([x, steps_completed, trial_id]))
            if core_context.preempt.should_preempt():
                rank = core_context.distributed.rank
                (out / f"preempted-{rank}").write_text(str(steps_completed))
                return
    if core_context.distributed.rank == 0:
        (out / "final.json").write_text(json.dumps({"x": x, "trial_id": trial_id, "hparams": hparams}))


def launcher_main(slots_per_node, cross_rank):
    procs = []
    for local_rank in range(slots_per_node):
        rank = cross_rank * slots_per_node + local_rank
        cmd = ["python3", "-m", "determined.launch.wrap_rank", str(rank), "--",
               "python3", __file__, "worker", str(rank), str(local_rank)]
        procs.append(subprocess.Popen(cmd))
    q = queue.Queue()
    threads = [threading.Thread(target=lambda p=p: q.put((p, p.wait()))) for p in procs]
    for t in threads:
        t.start()
    first_failed_exit = 0
    for _ in range(slots_per_node):
        proc, worker_exit = q.get()
        procs.remove(proc)
        if worker_exit != 0 and first_failed_exit == 0:
            first_failed_exit = worker_exit
            for other in procs:
                other.kill()
    for t in threads:
        t.join()
    return first_failed_exit


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    out = pathlib.Path(os.environ["TOOLKIT_OUTPUT_DIR"])
    slots_per_node, num_nodes = len(info.slot_ids), len(info.container_addrs)
    cross_rank, chief_ip = info.container_rank, info.container_addrs[0]
    if sys.argv[1] == "launcher":
        sys.exit(launcher_main(slots_per_node, cross_rank))
    rank, local_rank = int(sys.argv[2]), int(sys.argv[3])
    distributed = det.core.DistributedContext(
        rank=rank, size=num_nodes * slots_per_node, local_rank=local_rank, local_size=slots_per_node,
        cross_rank=cross_rank, cross_size=num_nodes, chief_ip=chief_ip,
    )
    with det.core.init(distributed=distributed) as core_context:
        main(core_context, info.latest_checkpoint, info.trial.trial_id, info.trial.hparams, out)
