"""Per-step overhead of toolkit's helpers in a training loop, as a ratio against the same loop without them.

    .venv/bin/python scripts/bench_overhead.py            # 2 CPU ranks under torchrun (it launches itself)
    .venv/bin/python scripts/bench_overhead.py --blocks 500 --steps 10     # the figures in docs/benchmarks.md
    .venv/bin/python scripts/bench_overhead.py --nproc 1 --blocks 20
    .venv/bin/python scripts/bench_overhead.py --arms helpers               # the three original arms only

The arms run in the same processes, in blocks of ``--steps`` steps, in a balanced set of orders
in turn (every arm in every position, after every other arm equally often: 10 orders for the five
arms, all 6 for three) so that drift in machine load hits all alike: "plain", "control" (the plain
loop again, whose ratio to "plain" shows what noise alone gives: an A/A test), and by default
(``--arms``):

* "helpers": every step ``MetricsWriter.report_training_metrics`` (loss + samples/s, averaged
  across ranks, written by the chief), ``PreemptionWatcher.should_preempt()`` and
  ``dsat_reporting_context`` (outside a trial);
* "compat": the same loop as a Determined user writes it, through ``toolkit.compat``: ``with
  det.core.init(distributed=det.core.DistributedContext.from_torch_distributed())``, ``op`` from
  ``core_context.searcher.operations()``, every step ``with dsat.dsat_reporting_context(core_context,
  op):`` around the step, ``core_context.train.report_training_metrics`` on the chief only (as in
  Determined) and ``core_context.preempt.should_preempt()``; the launcher writes the experiment
  YAML it reads (``TOOLKIT_EXPERIMENT_CONFIG``, ``TOOLKIT_OUTPUT_DIR``) to a temporary directory;
* "rare": the plain loop plus ``should_preempt()`` of a watcher of its own (toolkit's defaults)
  every ``--rare-every`` steps (default: at least 20, and 1.5 check intervals of the measured step
  time), so calls further apart than the check interval, which agree synchronously (a blocking
  all-reduce at the call); its cost per call is printed beside the "helpers" arm's every-step one.

Checkpoints are excluded (they run every N steps and cost what DeepSpeed's save costs).

Pace of the periodic work: the preemption check points and the metrics collective are paced in
seconds, adapted from the time between calls. Interleaved among N arms, the "helpers" arm gets
1/N of the wall time, so the adaptive rules would put N check points and N collectives on its
steps for every one a real loop of the same step time pays. By default (``--cadence loop``) the
intervals are therefore fixed, in calls, to what those rules give a loop of this step time
alone (step time measured after warm-up; printed), for the "compat" arm's watcher too (which
``det.core.init`` creates; the benchmark gives it the same ``check_every``); ``--cadence
adaptive`` shows the inflated figure. The same holds for the watcher's switch to synchronous
checks (made when check points fall more than ``check_interval`` apart, as calls made rarely
do): interleaved, the "helpers" arm's check points fall about N times further apart than a loop
alone's, so under ``--cadence loop`` its watchers get ``check_interval`` times 1.5 N, and
switch, or not, as a loop of this step time alone does (not, when the step is shorter than the
check interval). The "rare" arm keeps toolkit's defaults: its calls are rare in a loop alone too.

Printed, from each block's time on the slowest rank: the ratio of the loops' total times
"helpers" / mean("plain", "control"), and "compat" / the same (target <= 1.01 for both; a cost
paid every few hundred steps, such as the metrics writer's batched collective, counts in full;
the two plain arms run the same code, so their mean is the baseline with the least noise), with
a 95% bootstrap interval over rounds (resampled in pairs: the arms of a round ran back to back,
so the machine's slow drift cancels) and the geometric mean of the per-round ratios beside it;
the same against "plain" alone and the A/A "control" / "plain" (how far two identical arms
drift apart in this run: the noise); the ratio of CPU time; the median step
time of each loop; the time spent inside each helper; and ``should_preempt()``'s cost per call
at both cadences. With 2 ranks that time includes waiting for the slower rank in the metrics
all-reduce, which the plain loop pays in DeepSpeed's gradient all-reduce instead, so the ratio
is the cost; ``--nproc 1`` shows the helpers' own CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    argv = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
             "--master_port", str(port), __file__, "--worker", "--blocks", str(args.blocks), "--steps",
             str(args.steps), "--width", str(args.width), "--only", args.only, "--cadence", args.cadence,
             "--arms", args.arms, "--rare-every", str(args.rare_every)]
            + (["--gc-freeze"] if args.gc_freeze else [])
            + (["--dump", str(Path(args.dump).resolve())] if args.dump else []))
    with tempfile.TemporaryDirectory() as tmp:  # the compat arm's experiment (toolkit.compat's info.py)
        experiment = Path(tmp) / "experiment.yaml"
        experiment.write_text("name: bench-overhead\nhyperparameters: {lr: 0.001}\nsearcher: {name: single, "
                              f"metric: loss, max_length: {{batches: {args.blocks * args.steps + 1}}}}}\n",
                              encoding="utf-8")
        env.update(TOOLKIT_EXPERIMENT_CONFIG=str(experiment), TOOLKIT_OUTPUT_DIR=str(Path(tmp) / "out"))
        return subprocess.run(argv, env=env, timeout=3600).returncode


def worker(args: argparse.Namespace) -> None:
    """One rank: every arm, in blocks, in turn; the chief prints. Call on all ranks. Long on purpose:
    the arms share one loop body, clock reads included, so that only the helper calls differ."""
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
    ds_config = toolkit.resolve_ds_config(config, data_parallel_size=ctx.world_size)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def step():
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    for _ in range(5):  # warm-up: first steps allocate and pick kernels
        step()
    # The step time, measured here and agreed so that every rank uses the same intervals: the
    # cadence of a loop alone (see "Pace" in the module docstring) and the rare arm's call spacing.
    warm = []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t0)
    (step_s,) = ctx.all_reduce([statistics.median(warm)], op="max")
    check_interval = inspect.signature(toolkit.watch_preemption).parameters["check_interval"].default
    watch_kw: dict = {}
    metrics_kw: dict = {}
    if args.cadence == "loop":
        from toolkit.metrics.writer import MetricsSettings

        reduce_secs = MetricsSettings().reduce_secs
        # The adaptive rule's interval (floor: check points at most check_interval apart), and a
        # check interval that keeps the synchronous switch where a loop alone has it (docstring).
        arms = 2 + len([a for a in ("helpers", "compat", "rare") if a in args.arms.split(",")])
        watch_kw = {"check_every": max(1, int(check_interval // step_s)),
                    "check_interval": 1.5 * arms * check_interval}
        metrics_kw = {"reduce_every": max(1, round(reduce_secs / step_s))}
        cadence = (f"cadence of a loop of {step_s * 1e3:.1f} ms steps alone: a preemption check point every "
                   f"{watch_kw['check_every']} calls ({check_interval:g} s), a metrics collective every "
                   f"{metrics_kw['reduce_every']} reports ({reduce_secs:g} s)")
    else:
        cadence = ("adaptive cadence inside the interleaved benchmark (N arms: N x the periodic work per "
                   "helper step)")
    # Rare calls further apart than the check interval, in a loop alone too: the synchronous path.
    rare_every = args.rare_every or max(20, math.ceil(1.5 * check_interval / step_s))
    if args.gc_freeze:  # diagnosis: what the cyclic GC's passes over the model's objects cost
        gc.collect()
        gc.freeze()
    use = set(args.only.split(","))
    names = [a for a in ("plain", "helpers", "control", "compat", "rare") if a in ("plain", "control") or a in
             args.arms.split(",")]
    times: dict[str, list[float]] = {a: [] for a in names}
    # CPU seconds of this process (all threads: gloo's included) per step, per block: unlike wall
    # time, not inflated when the machine's other tenants take the core away for a while.
    cpu: dict[str, list[float]] = {a: [] for a in names}
    inside: dict[str, list[float]] = {a: [] for a in names}
    parts = {a: dict.fromkeys(PARTS, 0.0) for a in names}
    done = dict.fromkeys(names, 0)
    rare_calls, rare_spent = 0, 0.0
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        metrics = stack.enter_context(toolkit.MetricsWriter(ctx, Path(tmp) / "tb", **metrics_kw))
        preemption = stack.enter_context(toolkit.watch_preemption(ctx, **watch_kw))
        # The rare arm's watcher, as a user creates it (adaptive): its calls are further apart
        # than check_interval, so it agrees synchronously at each call.
        rare_watch: Any = stack.enter_context(toolkit.watch_preemption(ctx)) if "rare" in names else None
        core_context: Any = None
        op = ops = core_context
        if "compat" in names:
            from toolkit.compat.determined.pytorch import dsat

            core_context = _enter_compat(stack, watch_kw)
            ops = core_context.searcher.operations()  # call on all ranks
            op = next(ops)

        def block(arm: str) -> None:
            # The same code for every arm, clock reads included: only the helper calls differ.
            nonlocal rare_calls, rare_spent
            native, compat, rare = arm == "helpers", arm == "compat", arm == "rare"
            ctx.barrier()
            start, cpu_start, spent = time.perf_counter(), time.process_time(), 0.0
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if native and "dsat" in use:
                    context = toolkit.dsat_reporting_context(engine, steps_completed=done[arm])
                    context.__enter__()
                elif compat and "dsat" in use:  # = with dsat.dsat_reporting_context(core_context, op):
                    context = dsat.dsat_reporting_context(core_context, op)
                    context.__enter__()
                t1 = time.perf_counter()
                loss = step()
                t2 = time.perf_counter()
                if native or compat:
                    if "dsat" in use:
                        context.__exit__(None, None, None)
                    done[arm] += 1
                t3 = time.perf_counter()
                if native and "metrics" in use:
                    metrics.report_training_metrics(done[arm], {"loss": loss.detach()}, samples=8)
                elif compat and "metrics" in use and ctx.is_chief:  # chief only, as in Determined
                    core_context.train.report_training_metrics(steps_completed=done[arm],
                                                               metrics={"loss": loss.item()})
                t4 = time.perf_counter()
                if native and "preempt" in use and preemption.should_preempt():
                    raise SystemExit("a signal arrived during the benchmark")
                elif compat and "preempt" in use and core_context.preempt.should_preempt():
                    raise SystemExit("a signal arrived during the benchmark")
                elif rare:
                    done[arm] += 1
                    if done[arm] % rare_every == 0:
                        r0 = time.perf_counter()
                        if rare_watch.should_preempt():
                            raise SystemExit("a signal arrived during the benchmark")
                        rare_calls, rare_spent = rare_calls + 1, rare_spent + time.perf_counter() - r0
                t5 = time.perf_counter()
                if native or compat or rare:
                    spent += (t1 - t0) + (t5 - t2)
                    parts[arm]["dsat_reporting_context"] += (t1 - t0) + (t3 - t2)
                    parts[arm]["report_training_metrics"] += t4 - t3
                    parts[arm]["should_preempt"] += t5 - t4
            times[arm].append((time.perf_counter() - start) / args.steps)
            cpu[arm].append((time.process_time() - cpu_start) / args.steps)
            inside[arm].append(spent / args.steps)

        # Balanced orders in turn (see _balanced_orders): whichever arm runs first after a barrier
        # pays for waking up, and slow drift of the machine's load hits all arms alike. "control"
        # is the plain loop again: its ratio to "plain" is what noise alone gives (an A/A test).
        orders = [[names[i] for i in row] for row in _balanced_orders(len(names))]
        for b in range(args.blocks):
            for arm in orders[b % len(orders)]:
                block(arm)
        if ops is not None:
            final = float(step().item())  # the searcher metric: one more step, on every rank
            if ctx.is_chief:
                op.report_completed(final)
            next(ops, None)  # Determined's check: the chief reported the operation
    rare_line = ""
    if "rare" in names:
        (rare_per_call,) = ctx.all_reduce([rare_spent / max(1, rare_calls)], op="max")
        apart = rare_every * step_s
        path = "over" if apart >= check_interval else "under (a loop alone: the pipeline, not synchronous)"
        rare_line = (f"  every {rare_every} steps ({apart:.2f} s apart in a loop alone, {path} the check "
                     f"interval {check_interval:g} s; 'rare' arm, {rare_calls} calls): "
                     f"{rare_per_call * 1e6:8.1f} us per call (mean, slowest rank)")
    _report(ctx, args, names, times, cpu, inside, parts, cadence=cadence, rare_line=rare_line,
            check_every=watch_kw.get("check_every"))


PARTS = ("report_training_metrics", "should_preempt", "dsat_reporting_context")


def _enter_compat(stack, watch_kw: dict):
    """``det.core.init`` as a Determined user writes it, entered on ``stack``. Call on all ranks.

    Under ``--cadence loop`` its preemption watcher (which ``det.core.init`` creates with
    toolkit's defaults) gets the same fixed ``check_every`` as the native arm's: the pace of a
    loop alone, not the one the interleaving would make it adapt to.
    """
    import toolkit
    from toolkit.compat import determined as det

    distributed = det.core.DistributedContext.from_torch_distributed()
    original = toolkit.watch_preemption
    toolkit.watch_preemption = functools.partial(original, **watch_kw)
    try:
        return stack.enter_context(det.core.init(distributed=distributed))
    finally:
        toolkit.watch_preemption = original


def _balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: n orders of n arms (2n when n is odd), each arm once in each position
    per n orders and right after each other arm equally often. Pure."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo if len(first) % 2 else hi)
        lo, hi = (lo + 1, hi) if len(first) % 2 == 0 else (lo, hi - 1)
    rows = [[(v + i) % n for v in first] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def _report(ctx, args, names, times, cpu, inside, parts, *, cadence: str, rare_line: str,
            check_every: int | None) -> None:
    """Agree the figures across ranks (call on all ranks) and print them. Long: a line per figure."""
    arms = [a for a in names if a not in ("plain", "control")]
    # Each block's time on the slowest rank: the loop's time (the ranks meet in every step's
    # gradient all-reduce, so a block ends when the slower one ends it). Every statistic below is
    # computed from these, once, on the chief (not the maximum over ranks of per-rank statistics,
    # which would be biased upwards).
    times = {a: ctx.all_reduce(times[a], op="max") for a in names}
    calls = args.blocks * args.steps
    cpu_totals = dict(zip(names, ctx.all_reduce([sum(cpu[a]) for a in names], op="sum"), strict=True))
    per_call = ctx.all_reduce([parts[a][p] / calls for a in arms for p in PARTS], op="max")
    own = ctx.all_reduce([statistics.median(inside[a]) for a in arms], op="max")
    if args.dump and ctx.is_chief:  # every block's time, slowest rank, per arm in run order
        Path(args.dump).write_text(json.dumps({"steps": args.steps, "times": times}))
    if not ctx.is_chief:
        return
    plain = statistics.median(times["plain"])
    step_med = [statistics.median(times[a]) for a in arms]
    base = [(p + c) / 2 for p, c in zip(times["plain"], times["control"], strict=True)]
    label = {"helpers": "helpers", "compat": "compat (Determined's Core API, toolkit.compat)", "rare": "rare"}
    print(f"ranks: {ctx.world_size}, blocks: {args.blocks} x {args.steps} steps each, model: example ResNet "
          f"width {args.width}, micro-batch 8, ZeRO 1; arms: {', '.join(names)}; helpers: {args.only}"
          + ("; gc frozen after warm-up" if args.gc_freeze else ""))
    print(cadence)
    print(f"plain loop        : {plain * 1e3:8.3f} ms/step (median of blocks, slowest rank)")
    print(f"control: plain / plain (A/A noise)  : {_ratio_line(times['control'], times['plain'])}; "
          f"CPU time {cpu_totals['control'] / cpu_totals['plain']:.4f}")
    for i, arm in enumerate(arms):
        print(f"--- {label[arm]}")
        print(f"loop with {arm:<8}: {step_med[i] * 1e3:8.3f} ms/step (median of blocks, slowest rank); "
              f"ratio of median block times {step_med[i] / plain:.4f}")
        target = "   target <= 1.01" if arm != "rare" else ""
        print(f"{arm} / mean(plain, control), total times: {_ratio_line(times[arm], base)}{target}")
        print(f"  {arm} / plain, same statistic  : {_ratio_line(times[arm], times['plain'])}")
        print(f"ratio of CPU time per step (all ranks, threads): {cpu_totals[arm] / cpu_totals['plain']:.4f}")
        print(f"time inside helper calls per step  : {own[i] * 1e6:8.1f} us ({own[i] / plain:.2%} of a plain "
              "step; median of blocks)")
        if arm != "rare":
            for j, name in enumerate(PARTS):
                print(f"  {name:<24}: {per_call[len(PARTS) * i + j] * 1e6:8.1f} us per call "
                      "(mean, slowest rank)")
    print("--- should_preempt(), cost per call at both cadences")
    if "helpers" in arms:
        every = (f"a check point every {check_every} calls, pipelined or synchronous as in a loop alone"
                 if check_every else "adaptive check points, synchronous when interleaving spaces them out")
        frequent = per_call[len(PARTS) * arms.index("helpers") + 1]
        print(f"  every step ({every}; 'helpers' arm): {frequent * 1e6:8.1f} us per call (mean, slowest)")
    if rare_line:
        print(rare_line)
    if ctx.world_size > 1:
        print("  (with several ranks this includes waiting in the all-reduces for the slower rank,\n"
              "   a wait the plain loop pays in DeepSpeed's own gradient all-reduce instead; the ratio\n"
              "   above is the cost; run with --nproc 1 for the helpers' own CPU time)")


def _ratio_line(arm: list[float], base: list[float], *, draws: int = 2000) -> str:
    """The ratio of total times ``sum(arm) / sum(base)`` with a 95% bootstrap interval over rounds
    (resampled in pairs, so each round's drift still cancels), and the geometric mean of the
    per-round ratios. Pure and seeded: repeatable.

    Why not the mean of per-round ratios (the figure until 2026-11-23): a block's time varies by
    about 7% here, and the mean of ``a / b`` over noisy ``b`` is biased upwards by about the
    square of that (Jensen's inequality): +0.3-0.5% measured in A/A runs, a third of the target.
    """
    rng, n = random.Random(0), len(arm)
    ratios = []
    for _ in range(draws):
        rounds = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(arm[i] for i in rounds) / sum(base[i] for i in rounds))
    ratios.sort()
    geometric = math.exp(statistics.fmean(math.log(a / b) for a, b in zip(arm, base, strict=True)))
    return (f"{sum(arm) / sum(base):.4f} (95% CI {ratios[int(0.025 * draws)]:.4f}-"
            f"{ratios[int(0.975 * draws) - 1]:.4f}; geometric mean of per-round ratios {geometric:.4f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=36, help="blocks per arm (10 orders of 5 arms, 6 of 3)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--only", default="metrics,preempt,dsat",
                        help="diagnosis: the helpers the 'helpers' and 'compat' arms call, comma-separated "
                             "(default: all)")
    parser.add_argument("--cadence", choices=("loop", "adaptive"), default="loop",
                        help="periodic helper work at the pace of a real loop of this step time (default), "
                             "or left to adapt inside the N interleaved arms (N x too often per helper step)")
    parser.add_argument("--arms", default="helpers,compat,rare",
                        help="arms besides 'plain' and 'control', comma-separated: 'helpers' (toolkit's "
                             "helpers), 'compat' (Determined's Core API through toolkit.compat), 'rare' "
                             "(the plain loop plus should_preempt() every --rare-every steps)")
    parser.add_argument("--rare-every", type=int, default=0,
                        help="steps between the 'rare' arm's should_preempt() calls (default 0: at least 20, "
                             "and 1.5 check intervals of the measured step time: the synchronous path)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="diagnosis: gc.freeze() after warm-up, in every arm")
    parser.add_argument("--dump", default="",
                        help="diagnosis: write every block's time (slowest rank), per arm, to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
