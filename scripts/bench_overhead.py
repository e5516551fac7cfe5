"""Per-step overhead of toolkit's helpers in a training loop, as a ratio against the same loop without them.

    .venv/bin/python scripts/bench_overhead.py            # 2 CPU ranks under torchrun (it launches itself)
    .venv/bin/python scripts/bench_overhead.py --nproc 1 --blocks 20

Three arms run in the same processes, in blocks of ``--steps`` steps, every order of the three
in turn so that drift in machine load hits all alike: "plain", "helpers", and "control" (the plain
loop again, whose ratio to "plain" shows what noise alone gives: an A/A test). "helpers" adds, every step:
``MetricsWriter.report_training_metrics`` (loss + samples/s, averaged across ranks, written by
the chief), ``PreemptionWatcher.should_preempt()`` and ``dsat_reporting_context`` (outside a
trial). Checkpoints are excluded (they run every N steps and cost what DeepSpeed's save costs).

Pace of the periodic work: the preemption check points and the metrics collective are paced in
seconds, adapted from the time between calls. Interleaved, the "helpers" arm gets a third of the
wall time, so the adaptive rules would put three check points and three collectives on its steps
for every one a real loop of the same step time pays. By default (``--cadence loop``) the
intervals are therefore fixed, in calls, to what those rules give a loop of this step time
alone (step time measured after warm-up; printed); ``--cadence adaptive`` shows the inflated
figure.

Printed: the ratio of the loops' total times (a cost paid every few hundred steps, such as the
metrics writer's batched collective, counts in full); the mean over rounds of the per-round
ratio "helpers" / mean("plain", "control") with a bootstrap 95% interval (target <= 1.01; the
two plain arms run the same code, so their mean is the baseline with the least noise), the same
against "plain" alone and the A/A "control" / "plain" (how far two identical arms drift apart
in this run); the ratio of CPU time; the median step time of each loop; and the time spent
inside each helper. With 2 ranks that time includes waiting for the slower rank in the metrics
all-reduce, which the plain loop pays in DeepSpeed's gradient all-reduce instead, so the ratio
is the cost; ``--nproc 1`` shows the helpers' own CPU time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(args: argparse.Namespace) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ops = ROOT / ".venv" / "torch_extensions"
    if "TORCH_EXTENSIONS_DIR" not in env and ops.is_dir():
        # DeepSpeed's CPU ops as scripts/setup.sh built them (and the venv's ninja, as scripts/test.sh
        # does), rather than a build of their own in ~/.cache, whose lock a killed build can leave.
        env["TORCH_EXTENSIONS_DIR"] = str(ops)
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    argv = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
             str(port), __file__, "--worker", "--blocks", str(args.blocks), "--steps", str(args.steps),
             "--width", str(args.width), "--only", args.only, "--cadence", args.cadence]
            + (["--gc-freeze"] if args.gc_freeze else []))
    return subprocess.run(argv, env=env, timeout=3600).returncode


def worker(args: argparse.Namespace) -> None:
    import logging

    import deepspeed
    import torch
    import torch.nn.functional as F

    import toolkit

    logging.getLogger("toolkit").setLevel(logging.WARNING)
    sys.path.insert(0, str(ROOT / "examples" / "core_api"))
    from train import ResNet  # the example's model: a realistic "small training step"

    ctx = toolkit.init_distributed()
    torch.manual_seed(0)
    model = ResNet(width=args.width, num_classes=10)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=toolkit.resolve_ds_config(config, data_parallel_size=ctx.world_size))
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def step():
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    for _ in range(5):  # warm-up: first steps allocate and pick kernels
        step()
    # --cadence loop: the intervals a loop of this step time alone gets (see "Pace" in the module
    # docstring); the step time is measured here and agreed, so every rank uses the same ones.
    watch_kw: dict = {}
    metrics_kw: dict = {}
    if args.cadence == "loop":
        import inspect

        warm = []
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            warm.append(time.perf_counter() - t0)
        (step_s,) = ctx.all_reduce([statistics.median(warm)], op="max")
        check_interval = inspect.signature(toolkit.watch_preemption).parameters["check_interval"].default
        from toolkit.metrics.writer import MetricsSettings

        reduce_secs = MetricsSettings().reduce_secs
        watch_kw = {"check_every": max(1, round(check_interval / step_s))}
        metrics_kw = {"reduce_every": max(1, round(reduce_secs / step_s))}
        cadence = (f"cadence of a loop of {step_s * 1e3:.1f} ms steps alone: a preemption check point every "
                   f"{watch_kw['check_every']} calls ({check_interval:g} s), a metrics collective every "
                   f"{metrics_kw['reduce_every']} reports ({reduce_secs:g} s)")
    else:
        cadence = "adaptive cadence inside the interleaved benchmark (3x the periodic work per helper step)"
    if args.gc_freeze:  # diagnosis: what the cyclic GC's passes over the model's objects cost
        import gc

        gc.collect()
        gc.freeze()
    use = set(args.only.split(","))
    times: dict[str, list[float]] = {"plain": [], "helpers": [], "control": []}
    # CPU seconds of this process (all threads: gloo's included) per step, per block: unlike wall
    # time, not inflated when the machine's other tenants take the core away for a while.
    cpu: dict[str, list[float]] = {"plain": [], "helpers": [], "control": []}
    inside: list[float] = []
    parts = dict.fromkeys(("report_training_metrics", "should_preempt", "dsat_reporting_context"), 0.0)
    with tempfile.TemporaryDirectory() as tmp, toolkit.MetricsWriter(ctx, Path(tmp) / "tb", **metrics_kw) as metrics, \
            toolkit.watch_preemption(ctx, **watch_kw) as preemption:
        done = 0

        def block(arm: str) -> None:
            # The same code for every arm, clock reads included: only the helper calls differ.
            nonlocal done
            helpers = arm == "helpers"
            ctx.barrier()
            start, cpu_start, spent = time.perf_counter(), time.process_time(), 0.0
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if helpers and "dsat" in use:
                    context = toolkit.dsat_reporting_context(engine, steps_completed=done)
                    context.__enter__()
                t1 = time.perf_counter()
                loss = step()
                t2 = time.perf_counter()
                if helpers:
                    if "dsat" in use:
                        context.__exit__(None, None, None)
                    done += 1
                t3 = time.perf_counter()
                if helpers and "metrics" in use:
                    metrics.report_training_metrics(done, {"loss": loss.detach()}, samples=8)
                t4 = time.perf_counter()
                if helpers and "preempt" in use and preemption.should_preempt():
                    raise SystemExit("a signal arrived during the benchmark")
                t5 = time.perf_counter()
                if helpers:
                    spent += (t1 - t0) + (t5 - t2)
                    parts["dsat_reporting_context"] += (t1 - t0) + (t3 - t2)
                    parts["report_training_metrics"] += t4 - t3
                    parts["should_preempt"] += t5 - t4
            times[arm].append((time.perf_counter() - start) / args.steps)
            cpu[arm].append((time.process_time() - cpu_start) / args.steps)
            if helpers:
                inside.append(spent / args.steps)

        # Every order of the three arms in turn: whichever runs first after a barrier pays for
        # waking up, and slow drift of the machine's load hits all arms alike. "control" is the
        # plain loop again: its ratio to "plain" is what noise alone gives (an A/A test).
        orders = list(itertools.permutations(times))
        for b in range(args.blocks):
            for arm in orders[b % len(orders)]:
                block(arm)
    plain, helpers, own = (statistics.median(times["plain"]), statistics.median(times["helpers"]),
                           statistics.median(inside))
    # Costs paid every few hundred steps (the metrics' batched collective) fall in a few blocks
    # only, which a median leaves out: the ratio of the arms' total times is the one to judge.
    total_plain, total_helpers, total_control = ctx.all_reduce(
        [sum(times["plain"]), sum(times["helpers"]), sum(times["control"])], op="max")
    calls = args.blocks * args.steps
    # Paired per round: each round runs the three arms back to back, so a ratio within a round
    # cancels the machine's slow drift. The mean of those ratios keeps the rounds in which a
    # helper paid its periodic costs (the metrics' batched collective and event-file writes);
    # a bootstrap over rounds gives its 95% interval, and the same for the A/A control.
    pairs = {name: [a / p for a, p in zip(times[name], times["plain"])] for name in ("helpers", "control")}
    # "plain" and "control" run the same code: their mean is the better baseline (half the
    # noise of either alone); against "plain" alone the A/A control shows how far one plain arm
    # drifts from the other in this run.
    pairs["pooled"] = [h / ((p + c) / 2) for h, p, c in zip(times["helpers"], times["plain"], times["control"])]
    summary = []
    for name in ("pooled", "helpers", "control"):
        mean, lo, hi = _mean_ci(pairs[name])
        summary += [mean, lo, hi, statistics.median(pairs[name])]
    paired = ctx.all_reduce(summary, op="max")
    cpu_totals = ctx.all_reduce([sum(cpu["plain"]), sum(cpu["helpers"]), sum(cpu["control"])], op="sum")
    agreed_parts = ctx.all_reduce([v / calls for v in parts.values()], op="max")
    agreed = ctx.all_reduce([plain, helpers, own], op="max")
    if ctx.is_chief:
        plain, helpers, own = agreed
        print(f"ranks: {ctx.world_size}, blocks: {args.blocks} x {args.steps} steps each, model: example ResNet "
              f"width {args.width}, micro-batch 8, ZeRO 1; helpers: {args.only}"
              + ("; gc frozen after warm-up" if args.gc_freeze else ""))
        print(cadence)
        print(f"plain loop        : {plain * 1e3:8.3f} ms/step (median of blocks, slowest rank)")
        print(f"loop with helpers : {helpers * 1e3:8.3f} ms/step")
        print(f"ratio of total times (all blocks)  : {total_helpers / total_plain:.4f}; against the mean of "
              f"plain and control: {2 * total_helpers / (total_plain + total_control):.4f}")
        print(f"control: plain / plain (A/A noise) : {total_control / total_plain:.4f}")
        print(f"ratio of median block times        : {helpers / plain:.4f}")
        print(f"helpers / mean(plain, control), mean of per-round ratios: {paired[0]:.4f} "
              f"(95% CI {paired[1]:.4f}-{paired[2]:.4f}; median {paired[3]:.4f})   target <= 1.01")
        print(f"  helpers / plain, same statistic  : {paired[4]:.4f} (95% CI {paired[5]:.4f}-{paired[6]:.4f}; "
              f"median {paired[7]:.4f})")
        print(f"  A/A control / plain, same        : {paired[8]:.4f} (95% CI {paired[9]:.4f}-{paired[10]:.4f}; "
              f"median {paired[11]:.4f})")
        print(f"ratio of CPU time per step (all ranks, all threads): {cpu_totals[1] / cpu_totals[0]:.4f}   "
              f"(A/A: {cpu_totals[2] / cpu_totals[0]:.4f})")
        print(f"time inside helper calls per step  : {own * 1e6:8.1f} us ({own / plain:.2%} of a plain step; "
              "median of blocks)")
        for name, per_call in zip(parts, agreed_parts):
            print(f"  {name:<24}: {per_call * 1e6:8.1f} us per call (mean, slowest rank)")
        if ctx.world_size > 1:
            print("  (with several ranks this includes waiting in the metrics all-reduce for the slower rank,\n"
                  "   a wait the plain loop pays in DeepSpeed's own gradient all-reduce instead; the ratio\n"
                  "   above is the cost; run with --nproc 1 for the helpers' own CPU time)")


def _mean_ci(values: list[float], *, draws: int = 2000) -> tuple[float, float, float]:
    """Mean and a 95% bootstrap interval (percentiles of resampled means), seeded: repeatable."""
    import random

    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(draws))
    return statistics.fmean(values), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=36, help="blocks per arm (6 orders of the 3 arms)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--only", default="metrics,preempt,dsat",
                        help="diagnosis: the helpers the 'helpers' arm calls, comma-separated (default: all)")
    parser.add_argument("--cadence", choices=("loop", "adaptive"), default="loop",
                        help="periodic helper work at the pace of a real loop of this step time (default), "
                             "or left to adapt inside the interleaved arms (3x too often per helper step)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="diagnosis: gc.freeze() after warm-up, in every arm")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
