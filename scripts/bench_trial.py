"""Benchmark: where one dsat trial's wall time goes, and what the start-up cuts save.

Run it from the repository root (about 2 minutes on a 2-core machine; docs/benchmarks.md, "Where a
dsat trial's time goes", has the figures)::

    .venv/bin/python scripts/bench_trial.py
    .venv/bin/python scripts/bench_trial.py --pairs 4 --output runs/bench_trial.json

The trials are real ones: dsat's own :class:`~toolkit.dsat.execution.runner.TrialRunner` starts
``examples/core_api/train.py`` under torchrun on 2 ranks (the launcher and 2 rank processes), with
the plan that ``python -m toolkit.dsat binary`` builds from the example's experiment made small
as in tests/dsat/test_e2e.py (ZeRO stage 1, 5 MB buckets, ``deterministic: false``; dsat's
default profile steps 3-5 and 3 s timed window), micro-batch 8.

Every process of a trial imports a probe (a ``sitecustomize`` put on ``PYTHONPATH`` for the trials
only) that attributes its wall time, exclusively, to the innermost phase running: the imports of
each package (torch._dynamo/_inductor apart), py-cpuinfo's ``get_cpu_info``, DeepSpeed's op loads,
the process group, ``deepspeed.initialize``, the warm-up and timed steps (from the trial
session's step context), the result (gather, write, barrier), and the exit after the process
group is destroyed; what no phase covers is the script's own code (model, data, loop). A thread
of this process notes when each process of the trial has exited (its ``/proc`` state), so the
table also shows the launcher's start, the interpreter's finalization, the launcher's teardown
and the runner's own share, and its rows add up to the trial's wall time (runner.start() to
runner.wait() returning).

Arms, interleaved (after, before, after, before, ...), after one warm-up trial not counted (it
builds or loads DeepSpeed's ops in this process, which every dsat run does once):

* **after**: the runner and the trial code as they are: py-cpuinfo measured once per run
  (:mod:`toolkit.dsat.trial.cpu_info`) and the heap frozen once the result is written
  (``TrialSession.report_and_exit``), so the interpreter's exit skips its last collections;
* **before**: both cut off (the runner hands out no py-cpuinfo answer, so each rank measures it
  itself; the probe makes ``gc.freeze`` a no-op in the trial's processes), as every trial ran
  before.

The probe's import hook costs every process a little; both arms pay it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "core_api"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EVENTS_ENV = "BENCH_TRIAL_EVENTS"

# The probe every process of a trial imports at start-up (written as work/site/sitecustomize.py).
PROBE = r'''
"""scripts/bench_trial.py's probe: attributes this process's wall time to the phase running."""
import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_DIR = os.environ.get("BENCH_TRIAL_EVENTS")


def _proc_start():
    """When this process was forked (wall clock; the kernel counts 10 ms ticks since boot)."""
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    wall, boot = time.time(), time.clock_gettime(time.CLOCK_BOOTTIME)
    return wall - (boot - ticks / os.sysconf("SC_CLK_TCK"))


if _DIR:
    _SITE = time.time()
    _stack = [["script (model, data, loop)", _SITE]]
    _excl = {}
    _marks = {}
    _done = []

    def _enter(name):
        t = time.time()
        top = _stack[-1]
        _excl[top[0]] = _excl.get(top[0], 0.0) + t - top[1]
        _stack.append([name, t])
        _marks.setdefault("first " + name, t)

    def _leave():
        t = time.time()
        name, start = _stack.pop()
        _excl[name] = _excl.get(name, 0.0) + t - start
        _stack[-1][1] = t

    def _switch(name):
        _leave()
        _enter(name)

    def _phase(name, fn, *, keep_on_exit=False):
        def wrapper(*args, **kwargs):
            _enter(name)
            leave = True
            try:
                return fn(*args, **kwargs)
            except SystemExit:
                leave = not keep_on_exit  # the exit phase goes on until the process ends
                raise
            finally:
                if leave:
                    _leave()
        wrapper.__wrapped__ = fn
        return wrapper

    def _write():
        if _done:
            return
        _done.append(1)
        t = time.time()
        while len(_stack) > 1:
            _leave()
        _excl[_stack[0][0]] = _excl.get(_stack[0][0], 0.0) + t - _stack[0][1]
        data = {"pid": os.getpid(), "argv": sys.argv, "rank": os.environ.get("RANK"),
                "proc_start": _proc_start(), "site": _SITE, "exit": t, "phases": _excl, "marks": _marks}
        with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as fh:
            json.dump(data, fh)

    atexit.register(_write)  # registered first: runs last
    if os.environ.get("BENCH_TRIAL_ARM") == "before":
        import gc
        gc.freeze = lambda: None  # the trial's exit as before toolkit froze the heap there
    _real_exit = os._exit

    def _os_exit(code):
        _write()
        _real_exit(code)

    os._exit = _os_exit
    with open(os.path.join(_DIR, f"{os.getpid()}.start"), "w") as fh:
        json.dump({"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv": sys.argv}, fh)

    def _group(name):
        if name.startswith(("torch._dynamo", "torch._inductor")):
            return "import torch._dynamo/_inductor"
        return "import " + name.split(".")[0]

    def _after_cpuinfo(module):
        module.get_cpu_info = _phase("py-cpuinfo get_cpu_info", module.get_cpu_info)

    def _after_builder(module):
        module.OpBuilder.load = _phase("DeepSpeed op loads", module.OpBuilder.load)

    def _after_c10d(module):
        module.init_process_group = _phase("process group", module.init_process_group)
        real_destroy = module.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            _enter("result: gather, write, barrier, destroy")
            try:
                return real_destroy(*args, **kwargs)
            finally:
                _leave()
                if _stack[-1][0].startswith("result"):
                    _switch("exit: unwind the script, atexit")
        module.destroy_process_group = destroy_process_group

    def _after_ds_comm(module):
        module.init_distributed = _phase("process group", module.init_distributed)

    def _after_deepspeed(module):
        module.initialize = _phase("engine build (deepspeed.initialize)", module.initialize)

    class _Step:
        def __init__(self, session, cm):
            self.session, self.cm = session, cm

        def __enter__(self):
            value = self.cm.__enter__()
            _enter("timed steps" if self.session.timing else "warm-up steps (and FLOPs step)")
            return value

        def __exit__(self, *exc):
            _leave()
            _enter("step bookkeeping")
            try:
                result = self.cm.__exit__(*exc)
            except SystemExit:
                raise
            except BaseException:
                _leave()
                raise
            _leave()
            return result

    def _after_session(module):
        cls = module.TrialSession
        real_step = cls.step

        def step(self, *args, **kwargs):
            return _Step(self, real_step(self, *args, **kwargs))
        cls.step = step
        cls.report_and_exit = _phase("result: gather, write, barrier, destroy", cls.report_and_exit,
                                     keep_on_exit=True)

    _AFTER = {"cpuinfo": _after_cpuinfo, "deepspeed.ops.op_builder.builder": _after_builder,
              "torch.distributed.distributed_c10d": _after_c10d, "deepspeed.comm.comm": _after_ds_comm,
              "deepspeed": _after_deepspeed, "toolkit.dsat.trial.session": _after_session}
    _LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.ExtensionFileLoader,
                importlib.machinery.SourcelessFileLoader)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            loader = spec.loader
            if not isinstance(loader, _LOADERS):
                return spec
            real_exec, group, after = loader.exec_module, _group(name), _AFTER.get(name)

            def exec_module(module):
                _enter(group)
                try:
                    real_exec(module)
                finally:
                    _leave()
                if after is not None:
                    after(module)
            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="before/after pairs, interleaved (default 3)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--deterministic", action="store_true",
                   help="the example's own deterministic: true (seed_everything imports torch._inductor)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_trial")
    p.add_argument("--output", type=Path, default=None, help="JSON of every trial's timeline")
    return p.parse_args(argv)


def write_experiment(args: argparse.Namespace, work: Path) -> Path:
    """The example's experiment as tests/dsat/test_e2e.py's small_setup makes it."""
    import yaml

    ds = json.loads((EXAMPLE / "ds_config.json").read_text())
    ds["zero_optimization"] = {"stage": 1, "reduce_bucket_size": 5_000_000,
                               "allgather_bucket_size": 5_000_000}
    (work / "ds_config.json").write_text(json.dumps(ds))
    config = yaml.safe_load((EXAMPLE / "deepspeed.yaml").read_text())
    config["hyperparameters"].update({"deepspeed_config": str(work / "ds_config.json"),
                                      "deterministic": bool(args.deterministic), "dataset_size": 4096,
                                      "validate_every": 1000, "checkpoint_every": 1000})
    path = work / "deepspeed.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class ExitWatch(threading.Thread):
    """Notes when each process of the current trial (its probe's .start files, the launcher) ends."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.events: Path | None = None
        self.pids: set[int] = set()
        self.gone: dict[int, float] = {}
        self.stop = threading.Event()

    def watch(self, events: Path, launcher: int | None = None) -> None:
        self.events, self.pids, self.gone = events, set() if launcher is None else {launcher}, {}

    def run(self) -> None:
        while not self.stop.wait(0.01):
            events = self.events
            if events is None:
                continue
            for start in events.glob("*.start"):
                self.pids.add(int(start.stem))
            for pid in list(self.pids - set(self.gone)):
                try:
                    state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                except (OSError, IndexError):
                    state = b"X"
                if state in (b"Z", b"X"):
                    self.gone[pid] = time.time()


def timeline(events: Path, gone: dict[int, float], launcher: int, t0: float, t_done: float) -> dict[str, Any]:
    """The trial's rows (seconds) from its processes' probe files and exit times."""
    procs = [json.loads(p.read_text()) for p in events.glob("*.json")]
    # py-cpuinfo's own interpreters inherit RANK too: the ranks are the script's processes
    ranks = sorted((p for p in procs if p["rank"] is not None and p["argv"][0].endswith("train.py")),
                   key=lambda p: int(p["rank"]))
    launch = next((p for p in procs if p["pid"] == launcher), None)
    if not ranks or launch is None:
        raise RuntimeError(f"probe files missing in {events}: {[p['pid'] for p in procs]}")
    chief = ranks[0]
    rows: dict[str, float] = {}
    rows["runner: start() until the launcher process exists"] = launch["proc_start"] - t0
    rows["launcher start: interpreter"] = launch["site"] - launch["proc_start"]
    first_rank = min(r["proc_start"] for r in ranks)
    imports = sum(v for k, v in launch["phases"].items() if k.startswith("import"))
    rows["launcher start: imports"] = imports
    rows["launcher start: rendezvous, spawn"] = first_rank - launch["site"] - imports
    rows["rank 0: interpreter start"] = chief["site"] - first_rank  # from the first rank's fork
    for name, seconds in sorted(chief["phases"].items()):
        rows[f"rank 0: {name}"] = seconds
    chief_gone = gone.get(chief["pid"], chief["exit"])
    rows["rank 0: interpreter finalization"] = chief_gone - chief["exit"]
    launcher_gone = gone.get(launcher, t_done)
    rows["launcher teardown (other ranks, exit barrier, its exit)"] = launcher_gone - chief_gone
    rows["runner: notice the exit, clean up, classify"] = t_done - launcher_gone
    return {"rows": rows, "total": t_done - t0, "sum": sum(rows.values()),
            "ranks_gone": {r["rank"]: gone.get(r["pid"]) for r in ranks}}


def stage1_trial(plan: Any, trial_id: int, micro_batch: int, *, profile: bool) -> tuple[Any, dict[str, Any]]:
    """A ZeRO stage 1 trial of ``plan`` and its complete DeepSpeed config, instrumented as dsat's
    trials are (scripts/bench_preload.py runs the same trials)."""
    from toolkit.config.deepspeed import overwrite_deepspeed_config
    from toolkit.dsat.contract import TrialContract
    from toolkit.dsat.tuning_plan import trial_ds_config
    from toolkit.dsat.search.space import zero_config_for_stage
    from toolkit.dsat.search.types import TrialSpec
    from toolkit.dsat.trial.reporting import instrumentation_overrides

    spec = TrialSpec(trial_id=trial_id, micro_batch=micro_batch, profile=profile,
                     zero=zero_config_for_stage(plan.search.base_zero, 1))
    config = trial_ds_config(plan.base_ds_config, spec, data_parallel_size=plan.data_parallel_size,
                             train_batch_size=plan.global_batch.train_batch_size,
                             hidden_size=plan.hidden_size)
    contract = TrialContract(spec.trial_id, "", plan.runner.start_profile_step, plan.runner.end_profile_step,
                             profile, plan.runner.memory_per_slot)
    return spec, overwrite_deepspeed_config(config, instrumentation_overrides(contract))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from toolkit.dsat.tuner_cli import build_parser, make_plan
    from toolkit.dsat.execution.runner import TrialRunner

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "site").mkdir(parents=True)
    (work / "site" / "sitecustomize.py").write_text(PROBE)
    experiment = write_experiment(args, work)
    plan = make_plan(build_parser().parse_args(
        ["binary", str(experiment), str(EXAMPLE), "--memory-per-slot", "1GiB", "--max-slots", "2",
         "--output-dir", str(work / "dsat")]))
    paths = [str(work / "site"), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    watch = ExitWatch()
    watch.start()
    arms = ["after"] + ["after", "before"] * args.pairs
    trials: list[dict[str, Any]] = []
    with TrialRunner(plan.runner, output_dir=work / "dsat") as runner:
        measured = runner._cpu_info_file
        for trial_id, arm in enumerate(arms, 1):
            runner._cpu_info_file = measured if arm == "after" else (lambda: None)  # type: ignore[method-assign]
            spec, config = stage1_trial(plan, trial_id, args.micro_batch, profile=False)
            events = work / "events" / f"trial_{trial_id}"
            events.mkdir(parents=True)
            os.environ[EVENTS_ENV] = str(events)
            os.environ["BENCH_TRIAL_ARM"] = arm
            t0 = time.time()
            runner.start(spec, ds_config=config, hparams=plan.hparams)
            watch.watch(events, runner._running[trial_id].process.pid)
            launcher = runner._running[trial_id].process.pid
            done: list[Any] = []
            while not done:
                done = runner.wait(timeout=1.0)
            t_done = time.time()
            time.sleep(0.05)
            result = done[0]
            label = "warm-up (not counted)" if trial_id == 1 else arm
            entry = {"trial_id": trial_id, "arm": label, "status": result.status.value,
                     "error": result.error, "latency_ms": result.metrics.get("latency"),
                     "wall_s": t_done - t0}
            try:
                entry.update(timeline(events, dict(watch.gone), launcher, t0, t_done))
            except (OSError, RuntimeError, ValueError) as err:
                entry["timeline_error"] = str(err)
            trials.append(entry)
            print(f"trial {trial_id} [{label}]: {result.status.value} in {entry['wall_s']:.2f} s", flush=True)
    watch.stop.set()
    return {"trials": trials, "yardstick_s": yardstick()}


def yardstick() -> float:
    start = time.time()
    sum(i * i for i in range(30_000_000))
    return time.time() - start


ORDER = ("runner: start", "launcher start", "rank 0: interpreter start", "rank 0: import",
         "rank 0: py-cpuinfo", "rank 0: DeepSpeed op", "rank 0: process group", "rank 0: engine build",
         "rank 0: script",
         "rank 0: warm-up", "rank 0: timed", "rank 0: step", "rank 0: result", "rank 0: exit",
         "rank 0: interpreter final", "launcher teardown", "runner: notice")


def report(summary: dict[str, Any]) -> str:
    """The table (medians per row and arm; the rows of one trial add up to its wall time)."""
    counted = [t for t in summary["trials"] if t["arm"] in ("before", "after") and "rows" in t]
    arms = {arm: [t for t in counted if t["arm"] == arm] for arm in ("before", "after")}
    names = list(dict.fromkeys(name for t in counted for name in t["rows"]))
    cells = {name: [statistics.median(t["rows"].get(name, 0.0) for t in arms[arm]) if arms[arm] else 0.0
                    for arm in ("before", "after")] for name in names}
    small = [n for n in names if n.startswith("rank 0: import ") and max(cells[n]) < 0.1]
    if small:
        cells["rank 0: import (other packages)"] = [sum(cells[n][i] for n in small) for i in (0, 1)]
        names = [n for n in names if n not in small] + ["rank 0: import (other packages)"]
    names.sort(key=lambda n: (next((i for i, p in enumerate(ORDER) if n.startswith(p)), len(ORDER)),
                              -max(cells[n]) if n.startswith("rank 0: import") else 0))
    lines = ["| where (exclusive wall time) | before (s) | after (s) |", "|---|---:|---:|"]
    lines += [f"| {n} | {cells[n][0]:.2f} | {cells[n][1]:.2f} |" for n in names]
    walls = {arm: [t["wall_s"] for t in arms[arm]] for arm in arms}
    med = {arm: statistics.median(w) if w else float("nan") for arm, w in walls.items()}
    lines.append(f"| **trial wall time (median)** | **{med['before']:.2f}** | **{med['after']:.2f}** |")
    lines.append("")
    for arm in ("before", "after"):
        lines.append(f"{arm}: " + ", ".join(f"{w:.2f}" for w in walls[arm]) + " s")
    lines.append(f"after / before (medians): {med['after'] / med['before']:.3f}")
    lines.append(f"yardstick: {summary['yardstick_s']:.2f} s")
    if small:
        shown = sorted(n.split()[-1] for n in small)
        lines.append(f"other packages ({len(shown)}, each < 0.1 s): " + ", ".join(shown[:8])
                     + (f" and {len(shown) - 8} more" if len(shown) > 8 else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    text = report(summary)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
