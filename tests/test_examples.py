"""The examples/core_api scripts, run for real: torchrun, the deepspeed launcher, resume, exact resume."""

import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import toolkit
from helpers import procutil
from helpers.examples import EXAMPLES, small_config


def scalars(log_dir, tag):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def _check_metrics(out, steps):
    """TensorBoard and metrics.jsonl hold each training step once, across the runs, and validation."""
    losses = scalars(out / "tensorboard", "training/loss")
    assert [step for step, _ in losses] == list(range(1, steps + 1)), losses
    assert scalars(out / "tensorboard", "validation/loss")
    lines = [json.loads(line) for line in (out / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert [r["steps_completed"] for r in lines if r["group"] == "training"] == list(range(1, steps + 1))


def test_pipeline_example_runs_under_torchrun_then_resumes_under_deepspeed(tmp_path):
    """mlm.py and causal_lm.py switch launchers on their resume in the SIGTERM test below."""
    script = "pipeline.py"
    config, out = small_config(tmp_path, script), tmp_path / "out"
    args = ["--config", str(config), "--output-dir", str(out)]
    procutil.check(procutil.run(procutil.torchrun_argv(EXAMPLES / script, *args, "--max-steps", "10")))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_10"
    # Started again under the other launcher with more steps: it continues from step 10.
    procutil.check(procutil.run(procutil.deepspeed_argv(EXAMPLES / script, *args, "--max-steps", "14"),
                                env=procutil.child_env(LOCAL_SIZE="2")))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_14"
    _check_metrics(out, 14)


def _final_weights(out, tmp_path, name):
    target = tmp_path / f"{name}.pt"
    toolkit.consolidate_checkpoint(out / "checkpoints", target)
    return torch.load(target, map_location="cpu", weights_only=True)


def _latest_step(checkpoints):
    try:
        return int((checkpoints / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):  # not written yet (it is replaced atomically)
        return 0


# The two token examples: ZeRO 2, and a training step that draws from the global RNG (mlm.py's
# masking, causal_lm.py's dropout), so the resume must restore the RNG streams; mlm.py's own model
# and RNG-isolated validation, causal_lm.py's transformers model. train.py (images, ResNet, ZeRO 1)
# is stopped by SIGTERMs at random moments and resumed bitwise-exactly by
# tests/reliability/test_chaos.py::test_short_chaos_campaign (torchrun to torchrun); the launcher
# switch does not depend on the model, and pipeline.py's is checked above.
@pytest.mark.parametrize("script, seed", [("mlm.py", 1), ("causal_lm.py", 3)])
def test_sigterm_at_a_random_moment_then_resume_under_deepspeed_is_bitwise_exact(tmp_path, script, seed):
    """Started under torchrun, stopped by SIGTERM to one rank at a random moment, resumed under the
    deepspeed launcher: the weights equal an uninterrupted run's, and every step is logged once."""
    # Steps take 15-60 ms here: a 0.1 s check interval answers within a few steps, so the signal,
    # sent in the first quarter, stops the run well before its end however fast the machine is.
    config = small_config(tmp_path, script, preemption_check_interval=0.1)
    steps = "90"  # the process start-up (about 15 s) dominates
    reference = tmp_path / "reference"
    procutil.check(procutil.run(procutil.torchrun_argv(EXAMPLES / script, "--config", str(config),
                                                       "--output-dir", str(reference), "--max-steps", steps)))

    out, rng = tmp_path / "interrupted", random.Random(seed)
    # The signal follows the run's progress, not the clock, so it lands mid-run however busy the
    # machine is: a random delay after the checkpoint of a random step of the first half (the
    # examples checkpoint every 5 steps here), a random rank. The first sixth: the watcher answers
    # within about two check intervals (0.2 s), a few steps.
    after_step, delay = rng.randrange(5, int(steps) // 6 + 1, 5), rng.uniform(0.0, 0.3)
    argv = procutil.torchrun_argv(EXAMPLES / script, "--config", str(config), "--output-dir", str(out),
                                  "--max-steps", steps)
    with open(tmp_path / "interrupted.log", "w+") as log:
        proc = subprocess.Popen(argv, env=procutil.child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while _latest_step(out / "checkpoints") < after_step:
                assert proc.poll() is None and time.monotonic() < deadline, \
                    f"the run never reached step {after_step}"
                time.sleep(0.02)
            time.sleep(delay)
            workers = [int(pid) for pid in subprocess.run(["pgrep", "-f", "-P", str(proc.pid), script],
                                                          capture_output=True, text=True).stdout.split()]
            assert len(workers) == 2, workers
            os.kill(rng.choice(workers), signal.SIGTERM)  # one rank only: the others must follow
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        log.seek(0)
        output = log.read()
    assert proc.returncode == 0, output[-4000:]
    assert "preempted" in output, output[-4000:]
    stopped_at = _latest_step(out / "checkpoints")
    assert after_step <= stopped_at < int(steps), f"the signal should land mid-run; stopped at {stopped_at}"

    # resume to the end under the other launcher
    procutil.check(procutil.run(procutil.deepspeed_argv(EXAMPLES / script, *argv[argv.index("--config"):]),
                                env=procutil.child_env(LOCAL_SIZE="2")))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{steps}"
    _check_metrics(out, int(steps))
    expected, got = _final_weights(reference, tmp_path, "a"), _final_weights(out, tmp_path, "b")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), f"{key} differs after resuming at step {stopped_at}"
