"""Preemption chaos and crashes during saves, on the data-parallel example (2 ranks, torchrun).

* SIGTERM at random moments (during start-up, during a checkpoint save, between saves), to one
  rank or to torchrun, each time restarted until done: every run resumes from the checkpoint it
  found and the final weights are bitwise equal to an uninterrupted run's.
* SIGKILL to one rank at random moments of ``save_checkpoint``: the checkpoint a resume would
  choose is always committed, complete and loadable (consolidated offline), never a partial one,
  and the run still ends bitwise equal.

* The stage matrix (full run only): for each ZeRO stage 0-3 with DeepSpeed's CPU Adam, 20 runs
  each stopped by a SIGTERM to rank 1 in the middle of a random step (``watch_preemption``),
  each resumed in a new process and compared, bitwise, with an uninterrupted run: every
  micro-batch loss after the resume and the final weights (tests/workers/ckpt_exact_resume.py;
  gradient accumulation 2, dropout, clipping, an LR scheduler).

Short run (CI): one campaign with 2 SIGTERMs (start-up, save); the SIGKILL during a save's
everyday version is tests/checkpoint/test_api.py::test_sigkill_during_a_save_leaves_the_previous_checkpoint
(both ranks killed inside a save at each of its phases, then an exact resume), the stage matrix's
tests/checkpoint/test_exact_resume.py. Full run
(``TOOLKIT_RELIABILITY_FULL=1``, scripts/reliability.py): 20 SIGTERMs and 10 SIGKILLs, in two
campaigns, and the stage matrix (80 resumes). Moments are drawn from ``TOOLKIT_RELIABILITY_SEED``
(printed in the report).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal

import pytest

from helpers import procutil, relutil

FULL = os.environ.get("TOOLKIT_RELIABILITY_FULL") == "1"  # set by scripts/reliability.py
SEED = int(os.environ.get("TOOLKIT_RELIABILITY_SEED", "20261121"))
TERM_CATEGORY = "preemption chaos (SIGTERM)"
KILL_CATEGORY = "crash during save (SIGKILL)"
MATRIX_CATEGORY = "exact resume, ZeRO 0-3"
EXACT = procutil.WORKERS / "ckpt_exact_resume.py"
MATRIX_STEPS, MATRIX_POINTS = 40, 20
EVERY = 2  # checkpoint every 2 steps: saves are frequent, so "during a save" is hit often


def _max_steps(shots: int) -> int:
    # Room for every shot to land before the run ends: a SIGTERM lets the run go on for up to two
    # preemption checks (0.25 s each: relutil.small_config sets that) before it stops: 10-45 steps
    # of this small model (measured).
    return 50 * shots + 100


def _term_plan(rng: random.Random, count: int) -> list[str]:
    base = ["startup", "save"] if count <= 2 else ["startup"] * (count // 5) + ["save"] * (2 * count // 5)
    plan = base + ["step"] * (count - len(base))
    rng.shuffle(plan)
    return plan


def _run(tmp_path, tally, plan: list[tuple[signal.Signals, str]], max_steps: int, reference, rng) -> None:
    planned = {sig for sig, _ in plan}  # a category is reported only where it was tried
    tallies = {sig: tally(category) for sig, category in
               ((signal.SIGTERM, TERM_CATEGORY), (signal.SIGKILL, KILL_CATEGORY)) if sig in planned}
    config = relutil.small_config(tmp_path, checkpoint_every=EVERY)
    campaign = relutil.Campaign(tmp_path, config, max_steps=max_steps, rng=rng)
    for sig, moment in plan:
        campaign.shoot(sig, moment)
    code, text = campaign.run_to_end()
    final = []
    if code != 0:
        final.append(f"the final launch exited {code}: {text[-1500:]}")
    elif relutil.committed_step(campaign.checkpoints) != max_steps:
        final.append(f"the final launch ended at step {relutil.committed_step(campaign.checkpoints)}, "
                     f"not {max_steps}")
    else:
        differing = relutil.compare_weights(reference(max_steps), campaign.checkpoints, tmp_path)
        if differing:
            final.append(f"final weights differ from the uninterrupted run: {differing[:5]}")
    for shot in campaign.shots:
        never = [] if shot.landed != "after-exit" else ["the signal was never delivered"]
        problems = shot.problems + final + never
        t = tallies[signal.Signals[shot.sig]]
        t.record(not problems, f"shot {shot.index} {shot.sig} {shot.landed} -> {shot.target}: {problems}")
    for sig, t in tallies.items():
        landed = collections.Counter(s.landed for s in campaign.shots if s.sig == sig.name)
        if landed:
            t.detail = f"seed {SEED}, landed during: " + ", ".join(
                f"{k} {v}" for k, v in sorted(landed.items()))
    summary = "\n".join(f"{s.index:2d} {s.sig:7s} planned {s.moment:7s} landed {s.landed:10s} {s.target:18s} "
                        f"steps {s.before:3d}->{s.after:3d} exit {s.exit_code} {s.problems}"
                        for s in campaign.shots)
    print(summary)
    assert not final and all(s.ok for s in campaign.shots), summary + "\n" + "\n".join(final)
    landed = collections.Counter((s.sig, s.landed) for s in campaign.shots)
    for sig, moment in set(plan):  # each kind of moment planned was really hit at least once
        assert landed[(sig.name, moment)] >= 1, (sig.name, moment, summary)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of the same config, one per max_steps, made when first needed."""
    made = {}

    def get(max_steps: int):
        if max_steps not in made:
            base = tmp_path_factory.mktemp(f"reference{max_steps}")
            made[max_steps] = relutil.run_reference(base, relutil.small_config(base, checkpoint_every=EVERY),
                                              max_steps=max_steps)
        return made[max_steps]
    return get


@pytest.mark.skipif(FULL, reason="the full run has its own, longer campaigns")
def test_short_chaos_campaign(tmp_path, tally, reference):
    rng = random.Random(SEED)
    # One SIGTERM of each kind of moment (a launch each, about 15 CPU-s): the full run repeats them
    # and adds the SIGKILLs during saves (their everyday check: see the module's docstring).
    plan = [(signal.SIGTERM, m) for m in _term_plan(rng, 2)] + [(signal.SIGKILL, "save")]
    rng.shuffle(plan)
    # The SIGKILL is drawn, then left out: the seed's draws stay as they were, and the SIGTERM
    # during a save goes to one rank (the hardest case: the other must follow), not to torchrun.
    plan = [shot for shot in plan if shot[0] == signal.SIGTERM]
    # 40 steps: room for the SIGTERM during a save (the first save is at step 2; the run stops
    # within about 10 steps of it here) to stop the run mid-way, and few enough that the final run
    # and the reference (about 0.15 CPU-s a step) stay short in CI.
    _run(tmp_path, tally, plan, 40, reference, rng)


@pytest.mark.reliability_full
def test_sigterm_at_20_random_moments(tmp_path, tally, reference):
    rng = random.Random(SEED)
    _run(tmp_path, tally, [(signal.SIGTERM, m) for m in _term_plan(rng, 20)], _max_steps(20), reference, rng)


@pytest.mark.reliability_full
def test_sigkill_during_10_saves(tmp_path, tally, reference):
    rng = random.Random(SEED + 1)
    _run(tmp_path, tally, [(signal.SIGKILL, "save")] * 10, _max_steps(20), reference, rng)  # one reference


def _matrix_losses(trained: dict, resumed: dict, case: str, point: int) -> list[str]:
    """What differs between the resume from the preemption at ``point`` and the uninterrupted run."""
    stop = trained[case]["preempted"][str(point)]["stopped_at"]
    if stop is None:
        return [f"SIGTERM in step {point}: the run never stopped"]
    reference, run = trained[case]["reference"], resumed[case][f"preempt{point}"]
    problems = [] if run["start"] == stop else [f"resumed at {run['start']}, stopped at {stop}"]
    for offset, (a, b) in enumerate(zip(reference["losses"][run["start"]:], run["losses"], strict=True)):
        if a != b:
            problems.append(f"losses differ from step {run['start'] + offset + 1}: {a} vs {b}")
            break
    if run["weights"] != reference["weights"]:
        problems.append("final weights differ")
    return problems


@pytest.mark.reliability_full
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matrix_20_random_preemptions_resume_bitwise(tmp_path, tally, stage):
    rng = random.Random(SEED + 100 + stage)
    points = sorted(rng.sample(range(1, MATRIX_STEPS - 1), MATRIX_POINTS))
    case = f"zero{stage}-ds"
    common = ["--cases", case, "--steps", str(MATRIX_STEPS), "--points", ",".join(map(str, points))]
    procutil.check(procutil.run(procutil.torchrun_argv(EXACT, str(tmp_path), "train", *common), timeout=900))
    # a new process:
    procutil.check(procutil.run(procutil.torchrun_argv(EXACT, str(tmp_path), "resume", *common), timeout=900))
    runs = [tuple(json.loads((tmp_path / f"{mode}_rank{rank}.json").read_text())
                  for mode in ("train", "resume")) for rank in range(2)]
    t = tally(MATRIX_CATEGORY)
    t.detail = f"zero{stage}: {MATRIX_POINTS} SIGTERM steps of {MATRIX_STEPS} (seed {SEED})"
    for point in points:
        problems = [f"rank {rank}: {x}" for rank, (trained, resumed) in enumerate(runs)
                    for x in _matrix_losses(trained, resumed, case, point)]
        t.record(not problems, f"zero{stage}, SIGTERM in step {point}: {problems}")
    print(f"zero{stage}: {t.survived}/{t.tried} resumes bitwise equal; points {points}")
    assert t.lost == 0, t.notes
