"""A Determined Core API script in the style of the tutorials (stages 2-4): only the import differs.

Two ranks train a tiny model; gradients are averaged with core_context.distributed.allgather;
the chief reports metrics and stores a checkpoint every `checkpoint_every` steps; every rank
asks should_preempt() after it. Test hooks (environment): DET_TEST_STEP_SLEEP slows each step,
DET_TEST_KILL_AT=N makes rank 0 SIGKILL itself inside store_path at step N, after a partial write
(on the trial's first run only, so that toolkit.run's restart goes through).
"""

import io
import json
import logging
import os
import pathlib
import signal
import time

import torch

from toolkit.compat import determined as det  # was: import determined as det


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1)
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def save_state(path, model, opt, steps_completed, trial_id):
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "steps": steps_completed,
            "trial_id": trial_id,
            "rng": torch.get_rng_state(),
        },
        path / "state.pt",
    )


def main(core_context, latest_checkpoint, trial_id, hparams):
    rank = core_context.distributed.rank
    model, opt = build(hparams["seed"])
    torch.manual_seed(hparams["seed"] + 1000 * rank)
    start = 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            state = torch.load(path / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["steps"] if state["trial_id"] == trial_id else 0
        torch.manual_seed(hparams["seed"] + 1000 * rank + 7 * start)
    first_run = det.get_cluster_info().trial._trial_run_id == 1
    kill_at = int(os.environ.get("DET_TEST_KILL_AT", "0")) if first_run else 0
    for batch in range(start, hparams["max_length"]):
        x = torch.randn(8, 4)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        grads = core_context.distributed.allgather([p.grad for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / len(grads)
        opt.step()
        steps_completed = batch + 1
        torch.manual_seed(hparams["seed"] + 1000 * rank + 7 * steps_completed)
        time.sleep(float(os.environ.get("DET_TEST_STEP_SLEEP", "0")))
        if steps_completed % hparams["checkpoint_every"] == 0:
            losses = core_context.distributed.gather(loss.item())
            if rank == 0:
                core_context.train.report_training_metrics(
                    steps_completed=steps_completed, metrics={"loss": sum(losses) / len(losses)}
                )
                core_context.train.report_progress(steps_completed / hparams["max_length"])
                with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (path, uuid):
                    save_state(path, model, opt, steps_completed, trial_id)
                    if steps_completed == kill_at:
                        (path / "partial").write_text("x")
                        os.kill(os.getpid(), signal.SIGKILL)
            if core_context.preempt.should_preempt():
                pathlib.Path(os.environ["TOOLKIT_OUTPUT_DIR"], f"preempted-{rank}").write_text(
                    str(steps_completed)
                )
                return
    if rank == 0:
        core_context.train.report_validation_metrics(
            steps_completed=hparams["max_length"], metrics={"loss": loss.item()}
        )
        buf = io.BytesIO()
        torch.save([p.detach() for p in model.parameters()], buf)
        out = pathlib.Path(os.environ["TOOLKIT_OUTPUT_DIR"])
        (out / "final.json").write_text(json.dumps({"weights": buf.getvalue().hex(), "trial_id": trial_id}))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    assert info is not None, "this example only runs on-cluster"
    distributed = det.core.DistributedContext.from_torch_distributed()
    with det.core.init(distributed=distributed) as core_context:
        main(core_context, info.latest_checkpoint, info.trial.trial_id, info.trial.hparams)
