"""Save/load round trips (ZeRO 0-3, pipeline), error cases, run ownership and keep_last, 2 ranks.

Usage: torchrun --nproc_per_node 2 ckpt_roundtrip.py OUT_DIR [KILLED_DIR...]
Writes OUT_DIR/rank<N>.json (what each rank saw) and OUT_DIR/<case>_expected.pt (the full weights
at the save, for the consolidation check of ckpt_single.py). First, the resume of each
KILLED_DIR (ckpt_kill.py's runs killed inside a save; its ``resume``): this launch is their new
process, one 2-rank launch fewer for the test.
"""
import json
import sys
from pathlib import Path

import ckpt_common as c
import ckpt_kill
import torch

import toolkit
import toolkit.checkpoint.api as tkc
from toolkit.checkpoint.api import load_checkpoint, save_checkpoint
from toolkit.checkpoint.layout import COMMIT_FILE, STARTED_FILE
from toolkit.errors import CheckpointError, ConfigError

out = Path(sys.argv[1])
ctx = toolkit.init_distributed()
record = {"cases": {}, "errors": {}}
ckpt_kill.resume([Path(d) for d in sys.argv[2:]])


def expect_error(name, fn, engine=None):
    """Run fn, which must raise CheckpointError or ConfigError; record the type, the message and
    whether DeepSpeed loaded."""
    touched = []
    if engine is not None:
        original = engine.load_checkpoint
        engine.load_checkpoint = lambda *a, **k: touched.append(1) or original(*a, **k)
    try:
        fn()
        record["errors"][name] = {"raised": None, "type": None, "deepspeed_touched": bool(touched)}
    except (CheckpointError, ConfigError) as err:
        record["errors"][name] = {"raised": str(err), "type": type(err).__name__,
                                  "deepspeed_touched": bool(touched)}
    finally:
        if engine is not None:
            engine.load_checkpoint = original


def run_case(case):
    """Train 2 steps, save, train 2 more; a fresh engine loads and trains the same 2 steps."""
    directory = out / case
    a = c.build(case)
    [c.train_step(a) for _ in range(2)]
    tag = save_checkpoint(a, directory, steps_completed=2, client_state={"case": case, "t": torch.arange(3)})
    torch.save(c.full_params(a), out / f"{case}_expected_rank{ctx.rank}.pt")
    params_a, optim_a = c.local_params(a), c.tensors_of(a.optimizer.state_dict())
    losses_a = [c.train_step(a) for _ in range(2)]
    params_a2 = c.local_params(a)

    b = c.build(case, seed=1)
    init_differs = c.local_params(b) != params_a
    steps, state = load_checkpoint(b, directory)
    params_b, optim_b = c.local_params(b), c.tensors_of(b.optimizer.state_dict())
    losses_b = [c.train_step(b) for _ in range(2)]
    record["cases"][case] = {
        "tag": tag, "steps": steps, "client_state": {"case": state["case"], "t": state["t"].tolist()},
        "init_differs": init_differs, "params_after_load": params_b == params_a,
        "optim_after_load": optim_b == optim_a, "optim_tensors": len(optim_a),
        "losses_a": losses_a, "losses_b": losses_b, "params_after_steps": c.local_params(b) == params_a2,
    }
    return b


# A pipeline engine leaves DeepSpeed's global model-parallel state behind: data-parallel engines
# cannot be built after it in this process, so the pipeline case runs last.
engines = {case: run_case(case) for case in c.CASES if case != "pipe"}
zero2 = c.build("zero2")
spare_zero1 = c.build("zero1")

# Errors: each must raise on every rank before DeepSpeed's load is called.
zero2 = c.build("zero2")
expect_error("zero_stage", lambda: load_checkpoint(zero2, out / "zero1"), zero2)
zero1 = engines["zero1"]
expect_error("missing_tag", lambda: load_checkpoint(zero1, out / "zero1", tag="step_99"), zero1)
expect_error("traversal_load", lambda: load_checkpoint(zero1, out / "zero1", tag="../zero0/step_2"), zero1)
expect_error("traversal_save", lambda: save_checkpoint(zero1, out / "zero1", steps_completed=5,
                                                                  tag="../escaped"))
record["escaped_exists"] = (out / "escaped").exists()
expect_error("rank_mismatch", lambda: save_checkpoint(zero1, out / "mismatch", steps_completed=5 + ctx.rank))

# Run ownership: another run id is refused; a process that forgot its run is refused until it loads.
own = out / "own"
save_checkpoint(zero1, own, steps_completed=10, run_id="run-a")
expect_error("other_run_id", lambda: save_checkpoint(zero1, own, steps_completed=11, run_id="run-b"))
tkc._run_ids.clear()  # as in a new process that has not loaded from the directory
expect_error("fresh_process", lambda: save_checkpoint(zero1, own, steps_completed=11))
record["own_resumed"] = load_checkpoint(engines["zero1"], own)[0]
save_checkpoint(engines["zero1"], own, steps_completed=11)
save_checkpoint(zero1, own, steps_completed=12, run_id="run-b", overwrite=True)
record["own_run"] = (own / "toolkit_run.json").read_text()

# keep_last: older committed checkpoints and crashed leftovers go; foreign and unrelated dirs stay.
keep = out / "keep"
save_checkpoint(zero1, keep, steps_completed=1)
if ctx.is_chief:
    (keep / "crashed").mkdir()
    (keep / "crashed" / STARTED_FILE).write_text("{}")
    (keep / "crashed" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    (keep / "foreign").mkdir()
    (keep / "foreign" / "mp_rank_00_model_states.pt").write_bytes(b"not ours")
    (keep / "notes").mkdir()
    (keep / "notes" / "readme.txt").write_text("keep me")
ctx.barrier()
listings = []
for step in (2, 3):
    save_checkpoint(zero1, keep, steps_completed=step, keep_last=2)
    listings.append(sorted(p.name for p in keep.iterdir()))  # exact on the chief, which deletes
save_checkpoint(zero1, keep, steps_completed=3, keep_last=2)  # same tag again: replaced
listings.append(sorted(p.name for p in keep.iterdir()))
record["keep_seq"] = json.loads((keep / "step_3" / COMMIT_FILE).read_text())["seq"]
record["keep_listings"] = listings
record["keep_latest"] = (keep / "latest").read_text()
record["keep_resumed"] = load_checkpoint(spare_zero1, keep)[0]

pipe = run_case("pipe")
expect_error("pipeline", lambda: load_checkpoint(zero2, out / "pipe"), zero2)
expect_error("not_pipeline", lambda: load_checkpoint(pipe, out / "zero0"), pipe)

c.write_json(out / f"rank{ctx.rank}.json", record)
