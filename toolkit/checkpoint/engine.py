"""What toolkit needs to know about a DeepSpeed engine before it saves or loads one. Any rank.

:func:`check_engine` refuses what toolkit checkpoints cannot handle; :func:`engine_facts` is the
layout a checkpoint records and a load compares (``layout.compatibility_problems``)."""

from __future__ import annotations

from typing import Any

from toolkit.errors import ConfigError
from toolkit.runtime.context import DistributedContext

__all__ = ["check_engine", "engine_facts"]

_ENGINE_METHODS = ("save_checkpoint", "load_checkpoint", "zero_optimization_stage")


def check_engine(engine: Any) -> None:
    """Refuse an engine toolkit cannot checkpoint: TypeError for an object that is not one, ConfigError
    for node-local checkpoint storage or a decoupled (asynchronous) checkpoint engine, which cannot
    commit through one shared directory. Any rank (no collective)."""
    if not all(hasattr(engine, name) for name in _ENGINE_METHODS):
        raise TypeError(f"engine={type(engine).__name__}: expected the DeepSpeed engine returned "
                        "by deepspeed.initialize()")
    problems = []
    if engine.use_node_local_storage():
        problems.append("checkpoint.use_node_local_storage=True: expected false (or unset); toolkit "
                        "checkpoints commit through one directory that every rank sees")
    if getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)():
        problems.append("the DeepSpeed checkpoint engine is decoupled (it writes after save returns): "
                        "expected a synchronous one; toolkit can only commit checkpoints written "
                        "synchronously, so leave the decoupled checkpoint engine out of the config")
    if problems:
        raise ConfigError(problems, source="the DeepSpeed config")


def engine_facts(engine: Any, ctx: DistributedContext) -> dict[str, Any]:
    """The engine's layout as a checkpoint records it (plain ints and bools). Any rank."""
    from deepspeed.runtime.pipe.engine import PipelineEngine  # deepspeed is loaded: engine is one

    pipeline = isinstance(engine, PipelineEngine)
    return {"world_size": ctx.world_size, "data_parallel_size": int(engine.dp_world_size),
            # Pipeline engines count their stages as model parallelism; keep tensor parallelism apart.
            "tensor_parallel_size": int(engine.grid.get_slice_parallel_world_size() if pipeline
                                        else engine.mp_world_size),
            "pipeline": pipeline,
            "pipeline_stages": int(engine.num_stages) if pipeline else None,
            "zero_stage": int(engine.zero_optimization_stage()),
            "bf16": bool(engine.bfloat16_enabled()), "fp16": bool(engine.fp16_enabled())}
