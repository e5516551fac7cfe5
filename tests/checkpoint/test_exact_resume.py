"""Exact resume (issue 14): the whole run after a resume is bitwise equal to an uninterrupted one.

Two launches of tests/workers/ckpt_exact_resume.py (2 ranks each; the second is a new process, as
after a crash): ZeRO stages 0-3 and a 2-stage pipeline engine, with DeepSpeed's CPU Adam
(FusedAdam's CPU build; DeepSpeedCPUAdam under ZeRO-3 offload) and torch's Adam
(``"zero_force_ds_cpu_optimizer": false``); gradient accumulation 2, dropout, gradient clipping
and a WarmupDecayLR scheduler. Each case resumes twice: from a save at step 5 of the
uninterrupted run, and from the checkpoint saved when rank 1 got SIGTERM in the middle of step
19 (``toolkit.watch_preemption``); every micro-batch loss of the remaining 22-37 steps and the
final weights must be bitwise equal.

The comparison can fail: resumed with toolkit's optimizer state restore switched off, every
DeepSpeed-Adam case differs (the CPU Adam kernels' ``beta**step`` products, see
toolkit/checkpoint/cpu_adam.py). Before the ZeRO-3 fix the stage-3 cases were resumed that way
(the replay found no stepped group): ``zero3-ds`` from step 5 matched 2 of 37 steps.
"""

import json

import pytest

import procutil as p

WORKER = p.WORKERS / "ckpt_exact_resume.py"
STEPS, FIXED, POINT = 42, 5, 19
DS_ADAM = ("zero0-ds", "zero1-ds", "zero2-ds", "zero3-ds", "pipe-ds")
CASES = (*DS_ADAM[:4], "zero3-offload", "zero0-torch", "zero1-torch", "zero2-torch", "zero3-torch",
         "pipe-ds", "pipe-torch")  # the pipeline engines last: see the worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("exact")
    common = ["--cases", ",".join(CASES), "--steps", str(STEPS), "--fixed", str(FIXED),
              "--points", str(POINT)]
    p.check(p.run(p.torchrun_argv(WORKER, str(out), "train", *common)))
    p.check(p.run(p.torchrun_argv(WORKER, str(out), "resume", *common, "--without-replay")))
    return [(json.loads((out / f"train_rank{rank}.json").read_text()),
             json.loads((out / f"resume_rank{rank}.json").read_text())) for rank in range(2)]


def _first_difference(reference: list, resumed: list, start: int) -> str | None:
    for offset, (a, b) in enumerate(zip(reference, resumed, strict=True)):
        if a != b:
            return f"step {start + offset + 1}: {a} (uninterrupted) vs {b} (resumed)"
    return None


@pytest.mark.parametrize("case", CASES)
def test_the_whole_remaining_run_is_bitwise_equal(runs, case):
    for rank, (trained, resumed) in enumerate(runs):
        reference = trained[case]["reference"]
        assert len(reference["losses"]) == STEPS
        # Every rank stopped at the same step, the one after the signal at the latest (check_every=1).
        assert trained[case]["preempted"][str(POINT)]["stopped_at"] in (POINT, POINT + 1)
        for name in ("fixed", f"preempt{POINT}"):
            run = resumed[case][name]
            start = run["start"]
            assert STEPS - start >= 20 and len(run["losses"]) == STEPS - start, (rank, name, start)
            assert _first_difference(reference["losses"][start:], run["losses"], start) is None, (
                rank, name, _first_difference(reference["losses"][start:], run["losses"], start))
            assert run["weights"] == reference["weights"], (rank, name, "final weights differ")
            # DeepSpeed's CPU Adams get their step state replayed (at ZeRO-3 too); torch's needs none.
            expected = [0] if case.endswith("-torch") else [start]
            assert run["replayed"] == expected, (rank, name, run["replayed"])


@pytest.mark.parametrize("case", DS_ADAM)
def test_without_the_optimizer_state_restore_the_resume_differs(runs, case):
    for rank, (trained, resumed) in enumerate(runs):
        reference, run = trained[case]["reference"], resumed[case]["without_replay"]
        assert run["replayed"] == [0]
        differs = _first_difference(reference["losses"][run["start"]:], run["losses"], run["start"])
        assert differs is not None and run["weights"] != reference["weights"], (rank, "no difference shown")
