"""Inside a dsat trial: time the training steps, write the trial's result and end the process.

One :class:`TrialSession` per process and engine, made by the reporting context or the engine's own
steps. Every rank; :meth:`TrialSession.report_and_exit` is a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import math
import os
import time
from typing import Any, Callable, Iterator, NoReturn

from toolkit._files import atomic_write_json
from toolkit.dsat.contract import PROGRESS_FILE, TrialContract
from toolkit.dsat.trial import profiling
from toolkit.dsat.trial.engine_hook import check_data_batch, check_engine
from toolkit.dsat.trial.oom import exit_on_oom
from toolkit.dsat.trial.profiling import ProfileProbe
from toolkit.dsat.tuned_keys import data_batch_sizes, engine_summary
from toolkit.errors import LaunchEnvError
from toolkit.runtime.trial_env import TRIAL_ENV
from toolkit.runtime.trial_oom import is_crashing, is_oom

__all__ = ["TrialSession", "extra_timed_steps", "read_contract", "reduce_metrics"]

logger = logging.getLogger(__name__)


def read_contract(contract_file: str) -> TrialContract:
    """The trial's :class:`TrialContract`, checked; :class:`LaunchEnvError` naming the fix when
    ``TRIAL_ENV`` names no readable contract. Any rank."""
    try:
        contract = TrialContract.read(contract_file)
    except (OSError, ValueError, TypeError) as err:
        raise LaunchEnvError(f"{TRIAL_ENV}={contract_file!r}: cannot read the trial contract ({err}); "
                             "it is set by the dsat trial runner, unset it to run outside a trial") from err
    start, end = contract.start_profile_step, contract.end_profile_step
    if not 1 <= start <= end:
        raise LaunchEnvError(f"trial contract {contract_file}: start_profile_step={start}, "
                             f"end_profile_step={end}; expected 1 <= start <= end")
    window, last = contract.timed_window_s, contract.last_profile_step
    if not math.isfinite(window) or window < 0 or (last is not None and last < end):
        raise LaunchEnvError(f"trial contract {contract_file}: timed_window_s={window}, last_profile_step="
                             f"{last}; expected a window >= 0 s and None or a last step >= {end}")
    return contract


def extra_timed_steps(step_s: list[float], *, window_s: float, room: int) -> int:
    """The steps to time after ``end_profile_step`` for the timed ones to span about ``window_s``, from
    their mean (``step_s``, the slowest rank's); at most ``room``. Pure; any rank."""
    total = sum(step_s)
    if not step_s or total >= window_s or room <= 0:
        return 0
    mean = total / len(step_s)
    return room if mean <= 0 else min(room, math.ceil((window_s - total) / mean - 1e-9))


def reduce_metrics(everyone: list[dict[str, Any]], *, samples_per_step: float) -> dict[str, float]:
    """The trial's five metrics from every rank's ``latency``, ``forward``, ``backward`` (ms per step)
    and ``flops`` (per step, None: not counted). Pure."""
    latency = max(r["latency"] for r in everyone)
    flops = [r["flops"] for r in everyone if r["flops"] is not None]
    seconds = latency / 1000.0
    return {
        "FLOPS_per_gpu": (sum(flops) / len(flops)) / seconds if flops and latency > 0 else 0.0,
        "throughput": samples_per_step / seconds if latency > 0 else 0.0,
        "forward": max(r["forward"] for r in everyone),
        "backward": max(r["backward"] for r in everyone),
        "latency": latency,
    }


def _engine_record(engine: Any) -> dict[str, Any]:
    """``{"engine": summary}`` of what the engine ran, for the autotuner's own check; ``{}`` for an
    object that is no DeepSpeed engine (a test's stand-in)."""
    try:
        return {"engine": engine_summary(engine)}
    except (AttributeError, TypeError):
        return {}


class TrialSession:
    """Per-process state of one trial: the contract, the timers wrapped around the engine."""

    def __init__(self, engine: Any, contract_file: str, *, auto: bool = False) -> None:
        import toolkit.runtime.context
        self.engine = engine
        self.path = contract_file
        self.contract = read_contract(contract_file)
        self.auto = auto  # driven by the engine's own steps, not by the reporting context
        # an engine deepspeed.initialize did not build under the trial's hook is checked here
        check_engine(engine, self.contract, how=None, merged=self.contract.merge_config)
        self.ctx = toolkit.runtime.context.init_distributed()  # adopts an existing process group
        from deepspeed.accelerator import get_accelerator
        self.accelerator = get_accelerator()
        self.pipeline = hasattr(type(engine), "_INSTRUCTION_MAP")
        self.fed: set[int] | None = None if self.pipeline else set()  # None: nothing (more) to check
        self.timing = False
        self.calls = {"forward": 0, "backward": 0}
        self.seconds = {"forward": 0.0, "backward": 0.0}
        self.step_s: list[float] = []
        self.micro_steps = 0
        self.flops_per_step: float | None = None
        self.forward_flops: int | None = None   # while the FLOPs step runs: its forwards' FLOPs so far
        self.counting = False                   # a forward is running under the FLOP counter
        self.profile: dict[str, Any] | None = None
        self.rss_start = profiling.rss_bytes()
        # the start-up's peak (engine built, no step yet), before a profiling trial resets it
        self.startup_peak = profiling.peak_memory_bytes(getattr(engine, "device", "cpu"))
        self.first_step: int | None = None   # steps are counted from the first one seen (resumed loops)
        self.step_calls = 0                   # calls of step(): the position when no count is given
        self.last_step = -1
        self.final_step: int | None = None   # the last timed step, decided at end_profile_step
        self.finished = False
        self._install_timers()
        if self.contract.profile:  # the peak of the training steps, not of the start-up
            profiling.reset_peak_memory(getattr(engine, "device", "cpu"))
        if self.ctx.is_chief:
            atexit.register(self._report_early_exit)

    def _sync(self) -> None:
        self.accelerator.synchronize()

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        session = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            session.calls[kind] += 1
            if session.fed is not None:  # until the first backward: the data's micro-batch is the engine's
                session._hold_data(kind, args, kwargs)
            if kind == "forward" and session.forward_flops is not None and not session.counting:
                return session._counted(fn, args, kwargs)
            if not session.timing:
                return fn(*args, **kwargs)
            session._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                session._sync()
                session.seconds[kind] += time.perf_counter() - start
        return wrapper

    def _hold_data(self, kind: str, args: Any, kwargs: Any) -> None:
        """Where each forward counts its examples; at the first backward, the last forward's are held to
        the engine's micro-batch (:func:`~toolkit.dsat.trial.engine_hook.check_data_batch`)."""
        if kind == "forward":
            self.fed = data_batch_sizes(args, kwargs)
            return
        fed, self.fed = self.fed, None
        check_data_batch(self.engine, self.contract, fed or set())

    def _counted(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One forward under torch's FLOP counter (aten level: only the model's arithmetic, so the
        same at every ZeRO stage), added to the step's count."""
        from torch.utils.flop_counter import FlopCounterMode
        counter = FlopCounterMode(display=False)
        self.counting = True
        try:
            with counter:
                return fn(*args, **kwargs)
        finally:
            self.counting = False
            if self.forward_flops is not None:
                self.forward_flops += int(counter.get_total_flops())

    def _install_timers(self) -> None:
        # Instance attributes shadow the class's methods for this engine only, and only in a trial.
        engine = self.engine
        if self.pipeline:
            from deepspeed.runtime.pipe import schedule
            table = dict(type(engine)._INSTRUCTION_MAP)
            table[schedule.ForwardPass] = self._timed("forward", table[schedule.ForwardPass])
            table[schedule.BackwardPass] = self._timed("backward", table[schedule.BackwardPass])
            engine._INSTRUCTION_MAP = table
        else:
            engine.forward = self._timed("forward", engine.forward)
            engine.backward = self._timed("backward", engine.backward)

    @contextlib.contextmanager
    def step(self, steps_completed: int | None) -> Iterator[None]:
        """Run one step in its role (FLOPs counted, timed, profiled); end the trial after the last.
        ``steps_completed`` None: the count of earlier calls."""
        c = self.contract
        if steps_completed is None:
            steps_completed = self.step_calls
        self.step_calls += 1
        if self.first_step is None:
            self.first_step = steps_completed
        k = steps_completed - self.first_step
        probe = ProfileProbe(self.engine, forwards=self.calls["forward"]) \
            if c.profile and self.profile is None else None
        flops = k == c.start_profile_step - 1     # this step's forwards go through the FLOP counter
        if flops:
            self.forward_flops = 0
        last_timed = c.end_profile_step if self.final_step is None else self.final_step
        timed = c.start_profile_step <= k <= last_timed
        forwards = self.calls["forward"]
        if timed:
            self._sync()
            self.timing = True
            start = time.perf_counter()
        try:
            yield
        except BaseException as err:
            self._abandon_step(err, probe)
            raise
        if timed:
            self._sync()
            self.step_s.append(time.perf_counter() - start)
            self.timing = False
            self.micro_steps += self.calls["forward"] - forwards  # micro-batches in this step
        self.last_step = k
        if probe is not None:
            self.profile = probe.measure(forwards=self.calls["forward"], memory_budget=c.memory_per_slot,
                                         local_world_size=self.ctx.local_world_size, rss_start=self.rss_start)
        if flops:
            self.flops_per_step = 3.0 * float(self.forward_flops or 0)
            self.forward_flops = None
        if k >= c.end_profile_step and self.final_step is None:
            self.final_step = self._final_step(k)
        self._note_progress(k)
        if self.final_step is not None and k >= self.final_step:
            self.report_and_exit()

    _progress_at = -1.0  # when the chief last wrote the progress file (time.monotonic)

    def _note_progress(self, k: int) -> None:
        """Chief only: ``progress.json`` (the runner's heartbeat), at most once a second and after the
        last step; a failed write never fails the trial."""
        last = self.final_step is not None and k >= self.final_step
        now = time.monotonic()
        if not self.ctx.is_chief or (now - self._progress_at < 1.0 and not last):
            return
        self._progress_at = now
        c = self.contract
        final = self.final_step if self.final_step is not None else c.end_profile_step
        with contextlib.suppress(Exception):
            atomic_write_json(os.path.join(os.path.dirname(self.path), PROGRESS_FILE), {
                "step": k + 1, "timed": len(self.step_s), "to_time": final - c.start_profile_step + 1,
                "peak_bytes": profiling.peak_memory_bytes(getattr(self.engine, "device", "cpu")),
                "time": time.time()}, sync=False)

    def _final_step(self, k: int) -> int:
        """The last timed step, from step ``k`` (``end_profile_step``): every rank decides the
        same from the slowest rank's step times (a collective when a window is set)."""
        c = self.contract
        room = c.final_step_bound - k
        if c.timed_window_s <= 0 or room <= 0:
            return k
        everyone = self.ctx.all_gather_object(list(self.step_s))
        slowest = max(everyone, key=sum)
        return k + extra_timed_steps(slowest, window_s=c.timed_window_s, room=room)

    def _abandon_step(self, err: BaseException, probe: ProfileProbe | None) -> None:
        """A step raised: undo its hooks; an OOM ends the process here, anything else propagates."""
        self.timing = False
        self.forward_flops = None
        with contextlib.suppress(Exception):  # undo the hooks; the step's own error matters
            if probe is not None:
                probe.remove()
        if is_oom(err):
            self.finished = True
            exit_on_oom(self.contract, err, rank=self.ctx.rank)

    def _local_measurements(self) -> dict[str, Any]:
        steps = max(len(self.step_s), 1)
        if self.profile is not None:  # the peak over every step of the trial, not just the first
            peak = profiling.peak_memory_bytes(getattr(self.engine, "device", "cpu"))
            self.profile["peak_bytes"] = max(int(self.profile.get("peak_bytes", 0)), peak)
            self.profile["startup_peak_bytes"] = int(self.startup_peak)
        # forward/backward seconds only accumulate while a timed step runs
        return {"latency": 1000.0 * sum(self.step_s) / steps,
                "forward": 1000.0 * self.seconds["forward"] / steps,
                "backward": 1000.0 * self.seconds["backward"] / steps,
                "flops": self.flops_per_step, "profile": self.profile, "over_budget": self._over_budget()}

    def _over_budget(self) -> str | None:
        """On CPU with a budget: why this rank's peak resident size exceeded it, else None (the runner
        polls the same peak; this catches one between two polls)."""
        budget = self.contract.memory_per_slot
        import torch
        if budget is None or torch.device(getattr(self.engine, "device", "cpu")).type != "cpu":
            return None
        peak = max(profiling.rss_bytes("VmHWM"), self.startup_peak)  # on CPU both are VmHWM
        if peak <= budget:
            return None
        return (f"peak RSS {peak / 2**20:.0f} MiB on rank {self.ctx.rank} exceeded the memory budget "
                f"{budget / 2**20:.0f} MiB per slot")

    def report_and_exit(self) -> NoReturn:
        """Gather the measurements, write the result (chief), end every rank. Call on all ranks."""
        everyone = self.ctx.all_gather_object(self._local_measurements())
        if self.ctx.is_chief:
            self._write_result(everyone)
        self.finished = True
        self.ctx.barrier()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        # Nothing after this measures the config: spare the interpreter's last garbage collections
        # the objects alive now (about 1 s of a rank's exit with torch, DeepSpeed and dynamo loaded,
        # docs/benchmarks.md). The loop's finally blocks, atexit and the exit status are as before.
        gc.freeze()
        raise SystemExit(0)

    def _write_result(self, everyone: list[dict[str, Any]]) -> None:
        """Chief only: the result file from the ranks' measurements (all of them, or its own)."""
        engine, c = self.engine, self.contract
        over = [r["over_budget"] for r in everyone if r["over_budget"]]
        if over:
            atomic_write_json(c.result_path, {"trial_id": c.trial_id, "status": "oom", "metrics": {},
                                              "profile": None, "error": over[0]})
            logger.error("dsat trial %d: %s", c.trial_id, over[0])
            return
        micro_per_step = self.micro_steps / max(len(self.step_s), 1) if self.micro_steps else 1.0
        samples = micro_per_step * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
        metrics = reduce_metrics(everyone, samples_per_step=samples)
        profile = profiling.merge_profiles([r["profile"] for r in everyone]) if c.profile else None
        atomic_write_json(c.result_path, {"trial_id": c.trial_id, "status": "ok", "metrics": metrics,
                                          "profile": profile, "timed_steps": len(self.step_s),
                                          **_engine_record(engine),
                                          "timed_by": "engine steps" if self.auto else "reporting context"})
        logger.info("dsat trial %d: %s over %d timed steps", c.trial_id,
                    ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()), len(self.step_s))

    def _report_early_exit(self) -> None:
        """atexit, chief only: the loop ended before the last timed step. After ``end_profile_step``
        report the chief's own timed steps (no collective: the others left); before, the trial failed."""
        if self.finished or is_crashing() or os.path.exists(self.contract.result_path):
            return
        c = self.contract
        if self.last_step >= c.end_profile_step and self.step_s:
            self._write_result([self._local_measurements()])
            return
        atomic_write_json(c.result_path, {
            "trial_id": c.trial_id, "status": "failed", "metrics": {}, "profile": None,
            "error": (f"the training loop stopped after {self.last_step + 1} step(s), before "
                      f"end_profile_step={c.end_profile_step}; let the entrypoint run at least "
                      f"{c.end_profile_step + 1} " + ("optimizer steps" if self.auto else
                                                      "steps with dsat_reporting_context around each"))})
