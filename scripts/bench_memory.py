"""dsat's memory model against real trials: predicted / found largest micro-batch per example and
ZeRO stage under a CPU budget, and the model FLOPs per sample per stage.

For each example of ``examples/core_api`` (train.py data parallel, pipeline.py, mlm.py,
causal_lm.py) and the MLP client ``scripts/clients/mlp.py`` (a user's plain loop) it runs dsat's own
profiling step (the micro-batch-1 profiling trial, the calibration trial and one trial per other
stage, :meth:`toolkit.dsat.orchestrator.Autotuner.run_profiling`), reads the predicted largest
micro-batch of each stage from ``profile.json`` (``dsat``), climbs the profiled stage's ladder of
points near its boundary (:func:`toolkit.dsat.search.calibration.climb`; once the profiling phase
climbs itself, only where its points stopped short; ``--no-climb``: none), then finds the real boundary with
2-rank trials of that stage under the same budget (``--memory-per-slot``, enforced on each rank's
resident size by dsat's runner): it probes the prediction, walks by 10% steps until the outcome
flips, and bisects the bracket to ``--tolerance``. ``found`` = the largest micro-batch that ran;
``ratio`` = predicted / found (target: within 0.8-1.2).

``--flops MB`` instead runs every example at micro-batch ``MB`` at each stage and prints the model
FLOPs per sample (``FLOPS_per_gpu x ranks / throughput``), which must not depend on the stage.

Run it from the repository root (CPU; minutes per example)::

    python scripts/bench_memory.py --memory-per-slot 1GiB
    python scripts/bench_memory.py --examples causal_lm --stages 1 2 3
    python scripts/bench_memory.py --flops 8
    python scripts/bench_memory.py --examples causal_lm --set d_model=128 seq_len=128   # the issue's GPT-2
    python scripts/bench_memory.py --examples mlp-1024x4 --stages 1 --memory-per-slot 900MB   # issue 29's MLP
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from toolkit.config.deepspeed import overwrite_deepspeed_config
from toolkit.dsat.tuner_cli import build_parser, make_plan, parse_bytes
from toolkit.dsat.contract import ProfileInfo, TrialContract, TrialStatus
from toolkit.dsat.execution.runner import TrialRunner
from toolkit.dsat.orchestrator import Autotuner, Plan, trial_ds_config
from toolkit.dsat.search import calibration, memory
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.dsat.trial.reporting import instrumentation_overrides

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "core_api"
CLIENTS = ROOT / "scripts" / "clients"
#: example -> (model directory, experiment YAML, the ZeRO stages it supports)
CASES = {"train": (EXAMPLES, "deepspeed.yaml", (1, 2, 3)), "pipeline": (EXAMPLES, "pipeline.yaml", (0, 1)),
         "mlm": (EXAMPLES, "mlm.yaml", (1, 2, 3)), "causal_lm": (EXAMPLES, "causal_lm.yaml", (1, 2, 3)),
         "mlp": (CLIENTS, "mlp.yaml", (1, 2, 3))}
#: named shapes: name -> (example, hyperparameters); ``--set`` still wins over them
SHAPES = {"mlp-256x2": ("mlp", {"width": 256, "depth": 2, "inputs": 256}),
          "mlp-1024x4": ("mlp", {"width": 1024, "depth": 4, "inputs": 1024}),
          "mlp-2048x8": ("mlp", {"width": 2048, "depth": 8, "inputs": 1024}),
          "gpt2-s64": ("causal_lm", {"d_model": 128, "seq_len": 64}),
          "gpt2-s128": ("causal_lm", {"d_model": 128, "seq_len": 128})}


def resolve(example: str, hparams: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``example`` (a case or a named shape) as its case and hyperparameters (``hparams`` win)."""
    case, preset = SHAPES.get(example, (example, {}))
    return case, {**preset, **hparams}


def make_example_plan(example: str, *, out: Path, stages: tuple[int, ...], budget: str,
                      hparams: dict[str, Any]) -> Plan:
    """dsat's plan for ``example`` (as ``python -m toolkit.dsat binary ...`` would build it), its
    experiment YAML copied beside ``out`` with ``hparams`` set in its hyperparameters."""
    case, hparams = resolve(example, hparams)
    model_dir, yaml_name, _ = CASES[case]
    experiment = yaml.safe_load((model_dir / yaml_name).read_text())
    experiment["hyperparameters"].update(hparams)
    if case == "pipeline":  # 2 pipeline stages on 2 ranks: one data-parallel replica
        experiment["hyperparameters"].setdefault("data_parallel_world_size", 1)
    config = out.parent / f"{example}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(experiment))
    argv = ["binary", str(config), str(model_dir), "--output-dir", str(out),
            "--memory-per-slot", budget, "--max-concurrent-trials", "1", "--zero-stages",
            *map(str, stages)]
    return make_plan(build_parser().parse_args(argv))


class Trials:
    """Runs single trials of a plan at a chosen stage and micro-batch, one at a time."""

    def __init__(self, plan: Plan, runner: TrialRunner) -> None:
        self.plan, self.runner, self.next_id = plan, runner, 1000

    def run(self, stage: int, micro_batch: int, *, profile: bool = False) -> TrialResult:
        zero = {**self.plan.search.base_zero, "stage": stage}
        if stage < 2:
            zero.pop("offload_optimizer", None)
        if stage < 3:
            zero.pop("offload_param", None)
        self.next_id += 1
        spec = TrialSpec(self.next_id, micro_batch, zero, line=0, profile=profile)
        config = trial_ds_config(self.plan.base_ds_config, spec,
                                 data_parallel_size=self.plan.data_parallel_size)
        runner = self.plan.runner
        contract = TrialContract(spec.trial_id, "", runner.start_profile_step, runner.end_profile_step,
                                 profile=profile)
        config = overwrite_deepspeed_config(config, instrumentation_overrides(contract))
        self.runner.start(spec, ds_config=config, hparams=self.plan.hparams)
        done: list[TrialResult] = []
        while not done:
            done = self.runner.wait(timeout=1.0)
        result = done[0]
        why = f": {result.error[:100]}" if result.error else ""
        peak = f", peak {result.profile['peak_bytes'] / 2**20:.1f} MiB" if result.profile else ""
        print(f"    stage {stage} mb {micro_batch}: {result.status.value} ({result.duration_s:.0f} s{peak})"
              f"{why}", flush=True)
        return result


def ms_per_micro_batch(result: TrialResult, data_parallel_size: int) -> float | None:
    """A trial's milliseconds per micro-batch from its throughput (as the profiling phase takes it)."""
    throughput = float(result.metrics.get("throughput") or 0.0) if result.metrics else 0.0
    return 1000.0 * result.spec.micro_batch * data_parallel_size / throughput if throughput > 0 else None


def climbed_prediction(plan: Plan, trials: Trials, out: Path) -> tuple[int, dict[int, int]]:
    """The profiled stage and the predictions after :func:`calibration.climb` continued dsat's
    profiling phase (``profile.json``) with its ladder of points near the boundary: what
    ``profiling_phase`` does once it calls ``climb`` for the profiled stage (a ladder already
    climbed there adds trials only where it stopped short). Other stages keep their measured extras."""
    recorded = json.loads((out / "profile.json").read_text())
    profile = ProfileInfo.from_json(recorded["profile"])
    first = ProfileInfo.from_json(recorded["measured"][0])
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines() if line.strip()]
    stage, dp = int(next(r["stage"] for r in rows if r["trial_id"] == 0)), plan.data_parallel_size
    profiled = sorted((r for r in rows if r["profile"] and r["status"] == "ok" and r["stage"] == stage),
                      key=lambda r: r["micro_batch"])
    times = [(int(r["micro_batch"]), 1000.0 * r["micro_batch"] * dp / r["throughput"]) for r in profiled
             if r.get("throughput")]
    model = memory.model_memory_bytes(profile, stage, data_parallel_size=dp)

    def measure(m: int) -> tuple[str, ProfileInfo | None, float | None]:
        result = trials.run(stage, m, profile=True)
        measured = None
        if result.profile:
            measured = ProfileInfo.from_json({**result.profile, "micro_batch": m,
                                              "memory_per_slot": int(profile.memory_per_slot)})
        return result.status.value, measured, ms_per_micro_batch(result, dp)

    climbed = calibration.climb(profile, stage, data_parallel_size=dp, first=first, times=times,
                                model_memory=model, measure=measure)
    prediction = memory.predict(climbed, data_parallel_size=dp, zero_stages=plan.search.zero_stages)
    return stage, {s: int(row["approx_max_micro_batch"]) for s, row in prediction.items()}


def find_boundary(trials: Trials, stage: int, predicted: int, *,
                  tolerance: float) -> tuple[int | None, int | None]:
    """(largest ok, smallest oom) around ``predicted``: 10% steps until the outcome flips, then
    bisection until ``smallest_oom - largest_ok <= max(1, tolerance * largest_ok)``."""
    ok: int | None = None
    oom: int | None = None
    mb = max(predicted, 1)
    while ok is None or oom is None:
        status = trials.run(stage, mb).status
        if status is TrialStatus.OK:
            ok = mb
            mb = max(int(mb * 1.1), mb + 1)
        elif status is TrialStatus.OOM:
            oom = mb
            if mb == 1:
                return None, 1
            mb = max(int(mb / 1.1), 1) if ok is None else mb
        else:
            raise RuntimeError(f"stage {stage} micro-batch {mb}: the trial ended {status.value}")
        if ok is not None and oom is not None:
            break
    while oom - ok > max(1, tolerance * ok):
        mb = (ok + oom) // 2
        if trials.run(stage, mb).status is TrialStatus.OK:
            ok = mb
        else:
            oom = mb
    return ok, oom


def bench_example(example: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Profile ``example`` with dsat, then find each stage's boundary; one row per stage."""
    supported = CASES[resolve(example, {})[0]][2]
    stages = tuple(s for s in (args.stages or supported) if s in supported)
    plan = make_example_plan(example, out=work / example, stages=stages, budget=args.memory_per_slot,
                             hparams=args.hparams)
    tuner = Autotuner(plan, say=lambda line: print("  " + line.replace("\n", "\n  "), flush=True))
    started = time.monotonic()
    if tuner.run_profiling() is None:
        raise RuntimeError(f"{example}: the profiling trial failed; see {work / example / 'trials'}")
    prediction = json.loads((work / example / "profile.json").read_text())["prediction"]
    rows = []
    with TrialRunner(plan.runner, output_dir=work / example / "boundary") as runner:
        trials = Trials(plan, runner)
        climbed: dict[int, int] = {}
        if args.climb:
            profiled, climbed = climbed_prediction(plan, trials, work / example)
            print(f"  climbed (stage {profiled}): {climbed}", flush=True)
        for stage in stages:
            dsat = int(prediction[str(stage)]["approx_max_micro_batch"])
            predicted = climbed.get(stage, dsat)
            ok, oom = find_boundary(trials, stage, predicted, tolerance=args.tolerance)
            rows.append({"example": example, "stage": stage, "dsat": dsat, "predicted": predicted,
                         "largest_ok": ok, "smallest_oom": oom, "ratio": predicted / ok if ok else None,
                         "dsat_ratio": dsat / ok if ok else None})
    print(f"  {example}: {time.monotonic() - started:.0f} s", flush=True)
    return rows


def flops_rows(example: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Model FLOPs per sample at each stage of ``example``, at micro-batch ``args.flops``."""
    supported = CASES[resolve(example, {})[0]][2]
    stages = tuple(s for s in (args.stages or supported) if s in supported)
    plan = make_example_plan(example, out=work / example, stages=stages, budget=args.memory_per_slot,
                             hparams=args.hparams)
    rows = []
    with TrialRunner(plan.runner, output_dir=work / example / "flops") as runner:
        trials = Trials(plan, runner)
        for stage in stages:
            m = trials.run(stage, args.flops).metrics
            ranks = plan.runner.slots_per_trial
            per_sample = m["FLOPS_per_gpu"] * ranks / m["throughput"] if m else float("nan")
            rows.append({"example": example, "stage": stage, "micro_batch": args.flops,
                         "flops_per_sample": per_sample})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", choices=sorted(CASES) + sorted(SHAPES), default=list(CASES),
                        help="examples, or named shapes: " + ", ".join(
                            f"{name} ({case} {' '.join(f'{k}={v}' for k, v in hp.items())})"
                            for name, (case, hp) in SHAPES.items()))
    parser.add_argument("--stages", nargs="+", type=int, default=None,
                        help="ZeRO stages (default: each example's supported stages)")
    parser.add_argument("--memory-per-slot", default="1GiB", help="CPU budget per rank (default 1GiB)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="bisect until the bracket is within this fraction of the largest ok (0.05)")
    parser.add_argument("--flops", type=int, default=None, metavar="MB",
                        help="instead: model FLOPs per sample per stage at micro-batch MB")
    parser.add_argument("--set", dest="hparams", nargs="+", default=[], metavar="KEY=VALUE",
                        help="hyperparameters to set in every example's YAML, e.g. d_model=128 seq_len=128")
    parser.add_argument("--climb", action=argparse.BooleanOptionalAction, default=True,
                        help="after dsat's profiling phase, climb the profiled stage's ladder of points "
                             "(calibration.climb; default on); --no-climb: dsat's prediction alone")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the trials' directories here (default: a temporary directory)")
    args = parser.parse_args()
    parse_bytes(args.memory_per_slot)
    args.hparams = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.hparams)}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        work = args.work.resolve() if args.work else Path(tmp)
        for example in args.examples:
            print(f"{example}:", flush=True)
            rows += (flops_rows if args.flops else bench_example)(example, args, work)
    print()
    if args.flops:
        print(f"{'example':<10} {'stage':>5} {'mb':>4} {'model FLOPs/sample':>19}")
        for r in rows:
            print(f"{r['example']:<10} {r['stage']:>5} {r['micro_batch']:>4} {r['flops_per_sample']:>19.4e}")
    else:
        print(f"budget {args.memory_per_slot} per rank (dsat: profile.json's prediction; predicted: after "
              f"the climb)\n{'example':<10} {'stage':>5} {'dsat':>7} {'predicted':>9} {'found':>6} "
              f"{'oom at':>6} {'ratio':>6} {'dsat ratio':>10}")
        for r in rows:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
            dsat_ratio = f"{r['dsat_ratio']:.2f}" if r["dsat_ratio"] else "-"
            print(f"{r['example']:<10} {r['stage']:>5} {r['dsat']:>7} {r['predicted']:>9} "
                  f"{str(r['largest_ok']):>6} {str(r['smallest_oom']):>6} {ratio:>6} {dsat_ratio:>10}")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r
                                         for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
