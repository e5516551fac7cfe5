"""The result file of a simulated dsat model (tests/workers/dsat_model_trial.py and
tests/reliability/workers/dsat_fault_model.py): metrics that grow with the micro-batch, a fixed
profile, written atomically as the trial contract asks.

Copied next to the model's ``model.py`` by ``procutil.install_sim_model`` (trials run the
model from their own directory, so this is imported from there).
"""
import json
import os
from pathlib import Path


def simulated_result(contract: dict, ds_config: dict, *, oom: bool = False) -> dict:
    """The chief's result: "oom" without metrics, or "ok" with the 5 metrics (+ the profile in
    the profiling trial). Latency grows with the micro-batch and the ZeRO stage."""
    mb = ds_config["train_micro_batch_size_per_gpu"]
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)  # none: the script's own (dsat knows none)
    latency = 10.0 + mb * (1.0 + 0.1 * stage)
    metrics = {} if oom else {"FLOPS_per_gpu": 1e6 * mb / latency * (1 + 0.01 * stage),
                              "throughput": 1000 * mb / latency,
                              "forward": latency / 3, "backward": latency / 2, "latency": latency}
    profile = {"num_params": 10**6, "trainable_params": 10**6, "activation_bytes_per_example": 10**6,
               "memory_per_slot": contract["memory_per_slot"] or 2**30, "baseline_bytes": 0,
               "half_precision": False, "device": "cpu"} if contract["profile"] else None
    return {"trial_id": contract["trial_id"], "status": "oom" if oom else "ok", "metrics": metrics,
            "profile": profile}


def write_result(contract: dict, result: dict) -> None:
    """Write ``result`` to the contract's result path atomically (a reader never sees half of it)."""
    tmp = Path(contract["result_path"] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, contract["result_path"])
