"""Benchmark: one ASHA search of Determined's tutorial model, sequential vs two trials at once.

Run it from the repository root (a few minutes on a small CPU machine)::

    .venv/bin/python scripts/bench_search.py
    .venv/bin/python scripts/bench_search.py --seed 7 --output runs/bench_search.json

The model is Determined's Core API tutorial ``3_hpsearch.py`` as tests/workers/det_hpsearch.py
renders it (imports swapped only): ``x`` grows by the trial's ``increment_by`` each batch (0.1 s,
the tutorial's ``time.sleep``), a validation report ``{x, batches}`` and a checkpoint every 10
batches, ``should_preempt()`` after each. The experiment is the tutorial's ``3_hpsearch.yaml``:
``adaptive_asha`` on ``x`` (smaller is better), 10 trials, ``time_metric: batches``,
``max_time: 100`` (Determined's default ``mode: standard``: brackets of 2 and 1 rungs), one slot per
trial, seeded (``reproducibility.experiment_seed``), so both arms draw the same 10 trials.

Both arms are ``python -m toolkit.run`` with ``--max-slots 2`` on this machine, one after the
other, each in a fresh output directory: **sequential** with ``max_concurrent_trials: 1``,
**concurrent** with ``max_concurrent_trials: 2``; ``--repeats N`` runs both N times, the order
alternating, and compares the medians (on a shared machine the load changes between arms).
Printed: each arm's wall time (the command's, start-up included), the ratio concurrent /
sequential (target <= 0.6; the acceptance bound 0.7), and the best trial each found (its
hyperparameters and metric, from ``determined_search.json``), with whether they agree. ASHA decides on the
reports in the order they arrive, so two arms may stop different trials; the best of a seeded
search is the same when its trial is never stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "det_hpsearch.py"

YAML = """name: bench-search
entrypoint: python3 det_hpsearch.py
hyperparameters:
  increment_by: {{type: int, minval: 1, maxval: 8}}
  max_length: 100
  report_every: 10
searcher:
  name: adaptive_asha
  metric: x
  smaller_is_better: true
  max_trials: {trials}
  time_metric: batches
  max_time: 100
  max_concurrent_trials: {concurrent}
resources: {{slots_per_trial: 1}}
reproducibility: {{experiment_seed: {seed}}}
max_restarts: 0
"""


def run_arm(work: Path, *, concurrent: int, seed: int, trials: int, step_s: float) -> dict:
    """One search in ``work``; its wall time, exit status and best trial."""
    model = work / f"model-{concurrent}"
    model.mkdir(parents=True)
    shutil.copy(WORKER, model / "det_hpsearch.py")
    (model / "exp.yaml").write_text(YAML.format(concurrent=concurrent, seed=seed, trials=trials),
                                    encoding="utf-8")
    out = work / f"out-{concurrent}"
    env = dict(os.environ, DET_TEST_STEP_SLEEP=str(step_s), PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "toolkit.run", str(model / "exp.yaml"), str(model), "--output-dir",
            str(out), "--max-slots", "2"]
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
    summary = json.loads((out / "determined_search.json").read_text(encoding="utf-8"))
    best = summary.get("best") or {}
    return {"max_concurrent_trials": concurrent, "wall_s": round(wall, 2), "exit_status": proc.returncode,
            "best": {k: best.get(k) for k in ("dir", "hparams", "metric")},
            "trials": [{k: t.get(k) for k in ("dir", "state", "metric", "time", "stopped_early", "bracket")}
                       for t in summary["trials"]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="reproducibility.experiment_seed of both arms")
    parser.add_argument("--trials", type=int, default=10, help="searcher.max_trials (the tutorial's 10)")
    parser.add_argument("--step-s", type=float, default=0.1, help="seconds per batch (the tutorial's 0.1)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each arm, the order alternating")
    parser.add_argument("--output", help="also write the figures here as JSON")
    args = parser.parse_args()
    arms = []
    for repeat in range(args.repeats):
        for n in ((1, 2) if repeat % 2 == 0 else (2, 1)):
            with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
                arms.append(run_arm(Path(tmp), concurrent=n, seed=args.seed, trials=args.trials,
                                    step_s=args.step_s))
    walls = {n: statistics.median(a["wall_s"] for a in arms if a["max_concurrent_trials"] == n)
             for n in (1, 2)}
    ratio = walls[2] / walls[1]
    same = len({(json.dumps(a["best"]["hparams"], sort_keys=True), a["best"]["metric"]) for a in arms}) == 1
    for arm in arms:
        print(f"max_concurrent_trials={arm['max_concurrent_trials']}: {arm['wall_s']:.1f} s, exit status "
              f"{arm['exit_status']}, best {json.dumps(arm['best'])}")
    print(f"wall-time ratio concurrent / sequential (medians of {args.repeats}): {ratio:.2f} "
          f"(target <= 0.6, acceptance <= 0.7); same best: {same}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"ratio": round(ratio, 3), "same_best": same, "arms": arms},
                                                indent=2) + "\n", encoding="utf-8")
    return 0 if all(a["exit_status"] == 0 for a in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
