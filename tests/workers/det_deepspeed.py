"""A Determined Core API DeepSpeed script in the style of Determined's dsat Core API example
(examples/deepspeed_autotune/torchvision/core_api/script.py): only the two imports differ.

Started by `python3 -m determined.launch.deepspeed python3 det_deepspeed.py`; every rank writes
its shard with store_path(shard=True) + engine.save_checkpoint(path). DET_TEST_STEP_SLEEP slows
each step so that a test can interrupt it.
"""

import logging
import os
import pathlib
import time

import deepspeed
import torch

from toolkit.compat import determined as det  # was: import determined as det
from toolkit.compat.determined.pytorch import dsat  # was: from determined.pytorch import dsat


def batch(step, rank, size):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 4, generator=gen)
    return x, x.sum(1, keepdim=True)


def main(core_context, hparams, latest_checkpoint):
    is_chief = core_context.distributed.rank == 0
    ds_config = dsat.get_ds_config_from_hparams(hparams)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(storage_id=latest_checkpoint) as path:
            model_engine.load_checkpoint(path)
    steps_completed = model_engine.global_steps
    for op in core_context.searcher.operations():
        while steps_completed < op.length:
            with dsat.dsat_reporting_context(core_context, op):
                # the engine's micro-batch (what dsat tunes; 2 in this script's own config)
                x, y = batch(steps_completed, core_context.distributed.rank,
                             model_engine.train_micro_batch_size_per_gpu())
                loss = ((model_engine(x) - y) ** 2).mean()
                model_engine.backward(loss)
                model_engine.step()
            time.sleep(float(os.environ.get("DET_TEST_STEP_SLEEP", "0")))
            if model_engine.is_gradient_accumulation_boundary():
                steps_completed += 1
                losses = core_context.distributed.gather(loss.item())
                if is_chief:
                    core_context.train.report_training_metrics(
                        steps_completed=steps_completed, metrics={"loss": sum(losses) / len(losses)}
                    )
                if not steps_completed % hparams["checkpoint_rate"]:
                    metadata = {"steps_completed": steps_completed}
                    with core_context.checkpoint.store_path(metadata=metadata, shard=True) as (path, _):
                        model_engine.save_checkpoint(path)
                    if core_context.preempt.should_preempt():
                        pathlib.Path(
                            os.environ["TOOLKIT_OUTPUT_DIR"], f"preempted-{model_engine.global_rank}"
                        ).write_text(str(steps_completed))
                        return
                if steps_completed == op.length:
                    if is_chief:
                        op.report_completed(sum(losses) / len(losses))
                    return


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    latest_checkpoint = info.latest_checkpoint
    hparams = info.trial.hparams
    distributed = det.core.DistributedContext.from_deepspeed()
    with det.core.init(distributed=distributed) as core_context:
        main(core_context, hparams, latest_checkpoint)
