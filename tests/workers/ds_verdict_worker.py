"""DeepSpeed's own verdict on each config of a table: ``deepspeed.initialize`` on a tiny model, then
two optimizer steps, on CPU, world size 1 (tests/config/test_ds_verdicts.py compares toolkit's).

Usage: python ds_verdict_worker.py ROWS_JSON
ROWS_JSON holds ``{"row name": ds_config, ...}``. For each row, in order, one line is printed:
``VERDICT {"name": ..., "verdict": "ran" | "refused", "error": "<type>: <message>"}``, flushed at
once, so that a run cut short by the test's timeout still reports the rows it judged. First, one line
``SCHEMA {...}``: the tables toolkit/config/ds_schema.py mirrors, read from the installed DeepSpeed.
"""
import copy
import gc
import inspect
import json
import logging
import sys
import time
import traceback

import deepspeed
import torch

import toolkit

PREFIX = "VERDICT "


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def train_two_steps(config: dict) -> None:
    """deepspeed.initialize with the config as given (no client optimizer), then 2 optimizer steps."""
    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=copy.deepcopy(config))
    try:
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else (
            torch.float16 if engine.fp16_enabled() else torch.float32)
        gen = torch.Generator().manual_seed(0)
        micro = engine.train_micro_batch_size_per_gpu()
        for _ in range(2 * engine.gradient_accumulation_steps()):
            x = torch.randn(micro, 4, generator=gen).to(dtype)
            y = torch.randint(0, 2, (micro,), generator=gen)
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {float(loss)} after 2 steps")
    finally:
        destroy = getattr(engine, "destroy", None)
        if destroy is not None:
            destroy()


def schema() -> dict:
    """What toolkit's ds_schema mirrors, as the installed DeepSpeed has it."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def keys(model):
        fields = model.model_fields
        return sorted(set(fields) | {field.alias for field in fields.values() if field.alias})

    def args(cls, skip):
        return [p for p in inspect.signature(cls.__init__).parameters.values()][skip:]

    schedulers = {}
    for name in ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        params = args(getattr(lr_schedules, name), 2)
        schedulers[name] = [[p.name for p in params if p.default is inspect.Parameter.empty],
                            [p.name for p in params if p.default is not inspect.Parameter.empty]]
    return {
        "models": {"zero_optimization": keys(DeepSpeedZeroConfig),
                   "zero_optimization.offload_param": keys(DeepSpeedZeroOffloadParamConfig),
                   "zero_optimization.offload_optimizer": keys(DeepSpeedZeroOffloadOptimizerConfig),
                   "fp16": keys(DeepSpeedFP16Config), "bf16": keys(DeepSpeedBF16Config)},
        "removed_top_level": sorted(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS),
        "removed_zero": sorted(ds_config._REMOVED_ZERO_CONFIG_KEYS),
        "optimizers": sorted(ds_config.DEEPSPEED_OPTIMIZERS),
        "schedulers": schedulers,
        "fused_adam": [p.name for p in args(FusedAdam, 2)],
        "cpu_adam": [p.name for p in args(DeepSpeedCPUAdam, 2)],
    }


def main() -> None:
    rows = json.loads(open(sys.argv[1], encoding="utf-8").read())
    print("SCHEMA " + json.dumps(schema()), flush=True)
    toolkit.init_distributed()
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # The objects of the imports never become garbage: out of the collector's sight, the collection
    # after each row (an engine holds reference cycles) takes milliseconds, not 0.1 s.
    gc.freeze()
    for name, config in rows.items():
        started = time.monotonic()
        try:
            train_two_steps(config)
            verdict = {"name": name, "verdict": "ran", "error": ""}
        except Exception as err:  # every refusal is a verdict; the next row still runs
            last = traceback.extract_tb(err.__traceback__)[-1]
            where = f" (at {last.filename.split('site-packages/')[-1]}:{last.lineno})"
            verdict = {"name": name, "verdict": "refused",
                       "error": f"{type(err).__name__}: {err}"[:1500] + where}
        gc.collect()
        verdict["seconds"] = round(time.monotonic() - started, 2)
        print(PREFIX + json.dumps(verdict), flush=True)


if __name__ == "__main__":
    main()
