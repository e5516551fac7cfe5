"""A simulated model for dsat orchestrator tests: plain Python (fast), driven by the trial contract.

Reads the trial's DeepSpeed config (``hyperparameters.deepspeed_config``) and behaves like a model
whose micro-batch limit is ``oom_above`` (hyperparameter): above it the chief reports "oom" and
exits 75, as dsat_reporting_context does on an out-of-memory error. Otherwise it reports metrics
that grow with the micro-batch (FLOPS_per_gpu, throughput) and a latency that grows too.
``profile`` hyperparameter: "ok" (default) or "crash" for the profiling trial; ``tuning``: "ok"
or "crash" for every other trial. Each start is appended to ``<trial dir>/starts.log``.
"""
import json
import os
import sys
import time
from pathlib import Path

hparams = json.loads(Path(os.environ["TOOLKIT_TRIAL_HPARAMS"]).read_text())
ds_config = json.loads(Path(hparams["deepspeed_config"]).read_text())
if "TOOLKIT_DSAT_TRIAL" not in os.environ:  # --run-full-experiment: a normal run, not a trial
    out = Path(os.environ["TOOLKIT_OUTPUT_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"full_run_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(ds_config))
    sys.exit(0)
contract = json.loads(Path(os.environ["TOOLKIT_DSAT_TRIAL"]).read_text())
rank = int(os.environ.get("RANK", "0"))
trial_dir = Path(contract["result_path"]).parent
with open(trial_dir / "starts.log", "a") as fh:
    fh.write(f"{rank} {time.time()}\n")

mb = ds_config["train_micro_batch_size_per_gpu"]
stage = ds_config["zero_optimization"]["stage"]
assert ds_config["train_batch_size"] == mb * ds_config["gradient_accumulation_steps"] * int(os.environ["WORLD_SIZE"])
behaviour = hparams.get("profile", "ok") if contract["profile"] else hparams.get("tuning", "ok")
time.sleep(float(hparams.get("sleep_s", 0.0)))
if behaviour == "crash":
    print("simulated crash: the model failed to build", file=sys.stderr)
    sys.exit(3)
if rank != 0:
    sys.exit(0)
oom = mb > int(hparams.get("oom_above", 10**9))
latency = 10.0 + mb * (1.0 + 0.1 * stage)
result = {"trial_id": contract["trial_id"], "status": "oom" if oom else "ok",
          "metrics": {} if oom else {"FLOPS_per_gpu": 1e6 * mb / latency * (1 + 0.01 * stage), "throughput": 1000 * mb / latency,
                                     "forward": latency / 3, "backward": latency / 2, "latency": latency},
          "profile": {"num_params": 10**6, "trainable_params": 10**6, "activation_bytes_per_example": 10**6,
                      "memory_per_slot": contract["memory_per_slot"] or 2**30, "baseline_bytes": 0,
                      "half_precision": False, "device": "cpu"} if contract["profile"] else None}
tmp = Path(contract["result_path"] + ".tmp")
tmp.write_text(json.dumps(result))
os.replace(tmp, contract["result_path"])
sys.exit(75 if oom else 0)
