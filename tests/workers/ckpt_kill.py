"""A save killed half-way, then a new run that resumes; ZeRO-3 on 2 ranks.

Usage:
    torchrun --nproc_per_node 2 ckpt_kill.py first OUT_DIR MODE
        Save step_2, train to step 4 (losses and weights to OUT_DIR/first_rank<N>.json), then save
        step_4 and stop inside that save at MODE, announced by OUT_DIR/paused_rank<N>, until the
        test SIGKILLs the ranks (their pids are in OUT_DIR/pid_rank<N>). MODE is one of
        ds_write    rank 1 stops after DeepSpeed wrote its first file (rank 0 waits in DeepSpeed)
        before_commit  every rank has written; the chief stops before writing the commit marker
        before_latest  the commit marker is written; the chief stops before replacing ``latest``
    torchrun --nproc_per_node 2 ckpt_kill.py resume OUT_DIR...
        For each OUT_DIR: a new run that first tries to save without loading (must be refused),
        loads, trains steps 3 and 4 and saves step_4; results to OUT_DIR/resume_rank<N>.json.
        (tests/checkpoint/test_api.py runs this as :func:`resume` inside the round-trip worker's
        launch, tests/workers/ckpt_roundtrip.py, a new process all the same.)
"""
import os
import sys
import time
from pathlib import Path

import ckpt_common as c

import toolkit
import toolkit.checkpoint.api as api
import toolkit.checkpoint.layout as layout
from toolkit.checkpoint.api import load_checkpoint, save_checkpoint
from toolkit.errors import CheckpointError


def pause(out):
    ctx = toolkit.get_context()
    (out / f"paused_rank{ctx.rank}").write_text("")
    time.sleep(600)  # the test kills this process long before


def install_pause(engine, out, mode):
    ctx = toolkit.get_context()
    if mode == "ds_write" and ctx.rank == 1:
        original = engine.checkpoint_engine.save

        def save_then_pause(*args, **kwargs):
            original(*args, **kwargs)
            pause(out)
        engine.checkpoint_engine.save = save_then_pause
    elif mode == "before_commit" and ctx.is_chief:
        original_write = api.atomic_write_json  # the name the save looks up

        def write(path, obj, **kwargs):
            if Path(path).name == layout.COMMIT_FILE:
                pause(out)
            original_write(path, obj, **kwargs)
        api.atomic_write_json = write
    elif mode == "before_latest" and ctx.is_chief:
        original_set = layout.set_latest

        def set_latest(root, tag):
            if tag == "step_4":
                pause(out)
            original_set(root, tag)
        layout.set_latest = set_latest


def first(out, mode):
    ctx = toolkit.get_context()
    (out / f"pid_rank{ctx.rank}").write_text(str(os.getpid()))
    engine = c.build("zero3")
    [c.train_step(engine) for _ in range(2)]
    save_checkpoint(engine, out / "ckpt", steps_completed=2, client_state={"phase": "first"})
    losses = [c.train_step(engine) for _ in range(2)]
    c.write_json(out / f"first_rank{ctx.rank}.json", {"losses": losses, "params": c.local_params(engine)})
    install_pause(engine, out, mode)
    save_checkpoint(engine, out / "ckpt", steps_completed=4)
    sys.exit(3)  # never reached when the test kills the save


def resume(dirs):
    """For each killed run's OUT_DIR, a new run's resume (call on all ranks)."""
    ctx = toolkit.get_context()
    for out in dirs:
        ckpt = out / "ckpt"
        engine = c.build("zero3", seed=1)
        record = {}
        try:
            save_checkpoint(engine, ckpt, steps_completed=0)
            record["save_before_load"] = None
        except CheckpointError as err:
            record["save_before_load"] = str(err)
        steps, state = load_checkpoint(engine, ckpt)
        record.update(steps=steps, client_state=state, losses=[c.train_step(engine) for _ in range(2)],
                      params=c.local_params(engine))
        record["tag"] = save_checkpoint(engine, ckpt, steps_completed=4, keep_last=1)
        record["listing"] = sorted(p.name for p in ckpt.iterdir())
        record["latest"] = (ckpt / "latest").read_text()
        c.write_json(out / f"resume_rank{ctx.rank}.json", record)


if __name__ == "__main__":
    toolkit.init_distributed()
    if sys.argv[1] == "first":
        first(Path(sys.argv[2]), sys.argv[3])
    else:
        resume([Path(d) for d in sys.argv[2:]])
