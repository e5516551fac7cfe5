"""A simulated model for dsat orchestrator tests: plain Python (fast), driven by the trial contract.

Reads the trial's DeepSpeed config (``hyperparameters.deepspeed_config``) and behaves like a model
whose micro-batch limit is ``oom_above`` (hyperparameter): above it the chief reports "oom" and
exits 75, as dsat_reporting_context does on an out-of-memory error. Otherwise it reports metrics
that grow with the micro-batch (FLOPS_per_gpu, throughput) and a latency that grows too.
``profile`` hyperparameter: "ok" (default) or "crash" for the profiling trial; ``tuning``: "ok"
or "crash" for every other trial. ``script_micro_batch``: the simulated engine runs this
micro-batch whatever the trial's config says, and its result says so (``engine``), as a real
trial's does. Each start is appended to ``<trial dir>/starts.log``.
"""
import json
import os
import sys
import time
from pathlib import Path

from dsat_sim_result import simulated_result, write_result  # copied beside this file

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
assert ds_config["train_batch_size"] == mb * ds_config["gradient_accumulation_steps"] * int(
    os.environ["WORLD_SIZE"]
)
behaviour = hparams.get("profile", "ok") if contract["profile"] else hparams.get("tuning", "ok")
time.sleep(float(hparams.get("sleep_s", 0.0)))
if behaviour == "crash":
    print("simulated crash: the model failed to build", file=sys.stderr)
    sys.exit(3)
if rank != 0:
    sys.exit(0)
oom = mb > int(hparams.get("oom_above", 10**9))
result = simulated_result(contract, ds_config, oom=oom)
if hparams.get("script_micro_batch"):
    result["engine"] = {"micro_batch": hparams["script_micro_batch"],
                        "gradient_accumulation_steps": ds_config["gradient_accumulation_steps"],
                        "stage": ds_config["zero_optimization"]["stage"],
                        "offload_optimizer": "none", "offload_param": "none"}
write_result(contract, result)
sys.exit(75 if oom else 0)
