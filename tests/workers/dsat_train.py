"""A tiny DeepSpeed training loop run as a dsat trial, for tests/dsat/trial/test_reporting.py.

Started by TrialRunner (torchrun, 2 ranks, CPU) as ``python3 dsat_train.py``, or as one rank under
plain ``python`` with a trial contract of the test's own; everything else comes from the trial's
hyperparameters (``toolkit.get_hparams()``):

    pipeline          2-stage PipelineEngine (engine.train_batch) instead of the data-parallel engine
    steps             steps of the loop (default 20)
    sleep_forward_ms  sleep inside the model's forward (a module)          -> "forward" >= this
    sleep_backward_ms sleep inside the backward (an autograd function)     -> "backward" >= this
    sleep_step_ms     sleep in the step, outside forward and backward      -> only "latency"
    first_step        the loop's first steps_completed (a loop resumed from a checkpoint; default 0)
    one_line          call dsat_reporting_context(engine) without steps_completed
    no_line           no dsat_reporting_context at all: dsat times the engine's own steps
    own_micro_batch   train this micro-batch whatever the trial's config says (a script with a
                      config of its own, its engine built where dsat's hook does not see it)
    mock_oom_at       [step, rank]: raise torch.cuda.OutOfMemoryError there, inside the step;
                      ["start", rank]: before deepspeed.initialize (outside any step). A real
                      CUDA OOM cannot happen on this CPU-only machine; the raise is what toolkit sees.

Model: Linear(16, 32) -> Sleep -> ReLU -> Linear(32, 4, bias frozen): 676 parameters, 672
trainable; per example the leaf outputs are 32 + 32 + 4 float32 = 272 bytes (Sleep returns a view
of its input: same storage, not counted twice); forward FLOPs per example as torch's FLOP counter
counts them (matrix products only): 2*16*32 + 2*32*4 = 1280.

Each rank writes ``stopwatch<rank>.json`` into the trial directory: its own wall time around each
``with`` block (perf_counter), the external stopwatch the test compares the metrics with.
"""
import contextlib
import json
import os
import time
from pathlib import Path

import deepspeed
import torch

import toolkit
from toolkit.dsat.trial.reporting import dsat_reporting_context


class Sleep(torch.nn.Module):
    def __init__(self, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.forward_ms, self.backward_ms = forward_ms, backward_ms

    def forward(self, x):
        time.sleep(self.forward_ms / 1000)
        return _SleepBackward.apply(x, self.backward_ms)


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.ms / 1000)
        return grad, None


def layers(h):
    last = torch.nn.Linear(32, 4)
    last.bias.requires_grad_(False)
    return [torch.nn.Linear(16, 32), Sleep(h.get("sleep_forward_ms", 0), h.get("sleep_backward_ms", 0)),
            torch.nn.ReLU(), last]


def main():
    ctx = toolkit.init_distributed()
    hparams = toolkit.get_hparams()
    ds_config = toolkit.get_ds_config_from_hparams(hparams)
    if hparams.get("own_micro_batch"):
        ds_config["train_micro_batch_size_per_gpu"] = hparams["own_micro_batch"]
    torch.manual_seed(0)
    contract = json.loads(Path(os.environ["TOOLKIT_DSAT_TRIAL"]).read_text())
    stopwatch_file = Path(contract["result_path"]).parent / f"stopwatch{ctx.rank}.json"
    mock_oom = hparams.get("mock_oom_at")
    if mock_oom == ["start", ctx.rank]:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory while placing the model (mocked)")

    if hparams.get("pipeline"):
        from deepspeed.pipe import PipelineModule
        net = PipelineModule(layers=layers(hparams), num_stages=2, loss_fn=torch.nn.MSELoss(),
                             partition_method="uniform")
    else:
        net = torch.nn.Sequential(*layers(hparams))
    engine, *_ = deepspeed.initialize(model=net, config=ds_config,
                                      model_parameters=[p for p in net.parameters() if p.requires_grad])
    mbs = engine.train_micro_batch_size_per_gpu()

    def batches():
        while True:
            yield torch.randn(mbs, 16), torch.randn(mbs, 4)

    data = batches()
    stopwatch = []
    first = int(hparams.get("first_step", 0))
    for step in range(first, first + int(hparams.get("steps", 20))):
        t0 = time.perf_counter()
        context = contextlib.nullcontext() if hparams.get("no_line") else \
            dsat_reporting_context(engine) if hparams.get("one_line") else \
            dsat_reporting_context(engine, steps_completed=step)
        try:
            with context:
                if mock_oom and [step - first, ctx.rank] == mock_oom:
                    raise torch.cuda.OutOfMemoryError(
                        "CUDA out of memory. Tried to allocate 2.00 GiB (mocked)"
                    )
                if hparams.get("pipeline"):
                    engine.train_batch(data)
                else:
                    x, y = next(data)
                    loss = torch.nn.functional.mse_loss(engine(x), y)
                    engine.backward(loss)
                    engine.step()
                time.sleep(hparams.get("sleep_step_ms", 0) / 1000)
        finally:
            stopwatch.append(time.perf_counter() - t0)
            stopwatch_file.write_text(json.dumps(stopwatch))


if __name__ == "__main__":
    main()
