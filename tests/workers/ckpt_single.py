"""One process (world size 1) against the 2-rank checkpoints of ckpt_roundtrip.py.

Usage: python ckpt_single.py OUT_DIR   (OUT_DIR as given to ckpt_roundtrip.py). First converts
zero1/step_2 to zero1/step_2_universal with DeepSpeed's ds_to_universal, its command line run in
this process (one interpreter start fewer than ``python -m deepspeed.checkpoint.ds_to_universal``).
Writes OUT_DIR/single.json.
"""
import runpy
import sys
from pathlib import Path

import ckpt_common as c
import torch

import toolkit
from toolkit.checkpoint.api import consolidate_checkpoint, load_checkpoint
from toolkit.errors import CheckpointError

out = Path(sys.argv[1])
step = out / "zero1" / "step_2"
sys.argv = ["ds_to_universal", "--input_folder", str(step), "--output_folder", f"{step}_universal",
            "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__")
ctx = toolkit.init_distributed()
record = {"world_size": ctx.world_size, "consolidated": {}}

# Saved by 2 ranks, loaded by 1: refused before DeepSpeed reads anything.
engine = c.build("zero1")
touched = []
original = engine.load_checkpoint
engine.load_checkpoint = lambda *a, **k: touched.append(1) or original(*a, **k)
try:
    load_checkpoint(engine, out / "zero1")
    record["world_size_error"] = None
except CheckpointError as err:
    record["world_size_error"] = str(err)
record["deepspeed_touched"] = bool(touched)

# consolidate_checkpoint: a plain state_dict for the plain model, equal to the weights at the save.
for case in c.CASES:
    expected = {}
    for rank in range(2):
        expected.update(torch.load(out / f"{case}_expected_rank{rank}.pt", weights_only=True))
    tag = consolidate_checkpoint(out / case, out / f"{case}_fp32.pt")
    state_dict = torch.load(out / f"{case}_fp32.pt", weights_only=True)
    model = torch.nn.Sequential(*c.make_layers())
    model.load_state_dict(state_dict)  # strict: same keys as the plain model
    record["consolidated"][case] = {
        "tag": tag, "keys": sorted(state_dict), "dtypes": sorted({str(v.dtype) for v in state_dict.values()}),
        "equal": sorted(expected) == sorted(state_dict)
        and all(torch.equal(expected[k], model.state_dict()[k]) for k in expected)}

# The fix the world-size error names: a universal checkpoint loads at world size 1.
universal = c.build("zero1", seed=1, load_universal=True)
steps, state = load_checkpoint(universal, out / "zero1", tag="step_2_universal")
expected = torch.load(out / "zero1_expected_rank0.pt", weights_only=True)
record["universal"] = {
    "steps": steps, "case": state["case"],
    "equal": all(torch.equal(expected[n], p) for n, p in universal.module.named_parameters()),
    "trains": c.train_step(universal) > 0}
c.write_json(out / "single.json", record)
