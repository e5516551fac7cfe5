"""Inside a dsat trial: time the training steps, write the trial's result, end the trial.

The only dsat-specific line in a user's loop is :func:`dsat_reporting_context` around each
training step::

    # torchrun --nproc_per_node 2 train.py     (or started by dsat as a trial: no change)
    for step, batch in enumerate(batches):
        with toolkit.dsat_reporting_context(engine, steps_completed=step):
            loss = engine(batch)                 # pipeline engines: engine.train_batch(it)
            engine.backward(loss)
            engine.step()

Outside a trial (:data:`~toolkit.dsat.contract.TRIAL_ENV` unset) it returns one shared
``contextlib.nullcontext`` and never touches the engine. Inside a trial, on every rank:

* ``steps_completed`` (the steps finished before this one) decides the step's role, counted
  from the first value seen in the process (a loop resumed from a checkpoint still gets its
  warm-up steps): the FLOPs are counted on step ``start_profile_step - 1`` and steps
  ``start_profile_step`` to ``end_profile_step`` (both included) are timed, the device
  synchronised around each one; after the last of them the chief writes the result file and
  every rank exits with status 0. Forward and backward are timed by wrapping this engine's
  ``forward``/``backward`` (pipeline engines: their ForwardPass/BackwardPass instructions) with
  instance attributes, set only inside a trial; DeepSpeed's own timers stay as configured.
* Metrics (:data:`~toolkit.dsat.contract.METRICS`), slowest rank for the times:
  ``latency`` = milliseconds per wrapped step (the whole body: forward, backward, optimizer
  and whatever else it does); ``forward`` and ``backward`` = milliseconds per step inside the
  engine's forward and backward (pipeline engines: the sums of their forward and backward
  micro-steps); ``throughput`` = samples per second over all ranks = micro-batches per step
  x ``train_micro_batch_size_per_gpu`` x data-parallel size / latency; ``FLOPS_per_gpu`` =
  model FLOPs per step on this rank / latency, averaged over ranks, with model FLOPs = 3 x the
  forward FLOPs that DeepSpeed's :class:`FlopsProfiler` counts (backward ~ 2 x forward;
  activation recomputation not counted, the convention of DeepSpeed's own autotuner).
* The profiling trial (``TrialContract.profile``, micro-batch 1) also records a
  :class:`~toolkit.dsat.contract.ProfileInfo` during its first wrapped step (see
  :func:`_profile_step`) and reports metrics as well.
* An out-of-memory error raised inside the step (``torch.OutOfMemoryError``, of which
  ``torch.cuda.OutOfMemoryError`` is an alias) writes status ``"oom"`` and ends the process with
  :data:`OOM_EXIT_STATUS` at once (``os._exit``: after an OOM the other ranks may never reach a
  collective, so no teardown is attempted). One that escapes uncaught elsewhere (typically
  ``deepspeed.initialize`` placing model states that do not fit) is written as ``"oom"`` too, by
  an excepthook installed when this module is imported in a trial process.

The result file (JSON, written atomically by the chief, or by the rank that ran out of memory)::

    {"trial_id": 3, "status": "ok" | "oom" | "failed", "metrics": {...5 metrics...},
     "profile": {...ProfileInfo...} | null, "error": "..." (oom / failed only)}

``"failed"`` is written only at a clean exit of a loop that stopped before
``end_profile_step`` (too few steps); the runner reports it as the trial's error.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import time
from typing import Any, Iterator

from toolkit._files import atomic_write_json
from toolkit.dsat.contract import OOM_EXIT_STATUS, TRIAL_ENV, ProfileInfo, TrialContract

__all__ = ["dsat_reporting_context", "instrumentation_overrides", "OOM_EXIT_STATUS"]

logger = logging.getLogger(__name__)


_NOOP = contextlib.nullcontext()
_UNSET = object()
_trial_file: Any = _UNSET            # memo of os.environ[TRIAL_ENV]: read once per process
_session: "_TrialSession | None" = None
_crashed = False                      # an uncaught exception is ending this process


def instrumentation_overrides(contract: TrialContract) -> dict[str, Any]:
    """DeepSpeed config keys to merge into every trial's config (never into the best config).

    The timing here wraps the engine's own methods and runs DeepSpeed's
    :class:`FlopsProfiler` itself, so no timer needs enabling; but DeepSpeed's config-driven
    flops profiler and autotuner must stay off in trials: both monkey-patch
    ``torch.nn.functional`` (counting twice) and the autotuner exits the process on its own.
    Pure; any process.

    Example::

        trial_config = merge(user_config, spec.ds_overrides(), instrumentation_overrides(contract))
    """
    del contract  # the same overrides for every trial
    return {"flops_profiler": {"enabled": False}, "autotuning": {"enabled": False}}


def dsat_reporting_context(engine: Any, *, steps_completed: int) -> contextlib.AbstractContextManager:
    """Wrap ONE training step; inside a dsat trial, measure it and end the trial. Call on all ranks.

    Args:
        engine: the engine from ``deepspeed.initialize`` (data-parallel or pipeline).
        steps_completed: training steps finished before this one (0 for the first).

    Returns:
        A context manager. Outside a trial: the same shared no-op object on every call.

    Raises:
        SystemExit: inside a trial, after ``end_profile_step`` (status 0, every rank), once the
            result is written.

    Example::

        # torchrun --nproc_per_node 2 train.py
        with toolkit.dsat_reporting_context(engine, steps_completed=step):
            engine.train_batch(data_iter)          # pipeline engine: one call is one step
    """
    global _trial_file, _session
    if _trial_file is _UNSET:
        _trial_file = os.environ.get(TRIAL_ENV) or None
    if _trial_file is None:
        return _NOOP
    if _session is None or _session.engine is not engine:
        _session = _TrialSession(engine, _trial_file)
    return _session.step(int(steps_completed))


def _rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident size (``VmRSS``) or its peak so far (``VmHWM``), in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not Linux: the peak is the best available
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _is_oom(err: BaseException) -> bool:
    import torch
    oom = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                            getattr(torch.cuda, "OutOfMemoryError", None)) if isinstance(t, type))
    return bool(oom) and isinstance(err, oom)


def _numel(p: Any) -> int:
    # ZeRO-3 leaves an empty placeholder in p and records the full size in ds_numel.
    return int(getattr(p, "ds_numel", p.numel()))


def _output_bytes(obj: Any, seen: set[int]) -> int:
    import torch
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_output_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_output_bytes(x, seen) for x in obj.values())
    return 0


def _state_bytes(engine: Any) -> int:
    """Bytes of the model state tensors on the engine: parameters, ZeRO partitions, grads, optimizer."""
    import torch
    found: list[torch.Tensor] = []

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.extend(t for t in (obj, getattr(obj, "grad", None), getattr(obj, "ds_tensor", None))
                         if isinstance(t, torch.Tensor))
        elif isinstance(obj, torch.optim.Optimizer):  # its state: {param: {"exp_avg": tensor, ...}}
            walk(list(obj.state.values()), 2)
        elif depth > 0 and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth - 1)
        elif depth > 0 and isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth - 1)

    walk(list(engine.module.parameters()), 1)
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None:  # a torch optimizer, or DeepSpeed's ZeRO / fp16 wrapper holding one
        walk(optimizer, 0)
        walk(dict(vars(optimizer)), 3)
    storages: dict[int, int] = {}
    for t in found:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _TrialSession:
    """Per-process state of one trial: the contract, the timers wrapped around the engine."""

    def __init__(self, engine: Any, contract_file: str) -> None:
        import toolkit.runtime.context
        self.engine = engine
        self.path = contract_file
        try:
            self.contract = TrialContract.read(contract_file)
        except (OSError, ValueError, TypeError) as err:
            raise RuntimeError(f"{TRIAL_ENV}={contract_file!r}: cannot read the trial contract ({err}); it "
                               "is set by the dsat trial runner, unset it to run outside a trial") from err
        c = self.contract
        if not 1 <= c.start_profile_step <= c.end_profile_step:
            raise RuntimeError(f"trial contract {contract_file}: start_profile_step={c.start_profile_step}, "
                               f"end_profile_step={c.end_profile_step}; expected 1 <= start <= end")
        self.ctx = toolkit.runtime.context.init_distributed()  # adopts an existing process group
        from deepspeed.accelerator import get_accelerator
        self.accelerator = get_accelerator()
        self.pipeline = hasattr(type(engine), "_INSTRUCTION_MAP")
        self.timing = False
        self.calls = {"forward": 0, "backward": 0}
        self.seconds = {"forward": 0.0, "backward": 0.0}
        self.step_s: list[float] = []
        self.micro_steps = 0
        self.flops_per_step: float | None = None
        self.profile: dict[str, Any] | None = None
        self.rss_start = _rss_bytes()
        self.first_step: int | None = None   # steps are counted from the first one seen (resumed loops)
        self.last_step = -1
        self.finished = False
        self._install_timers()
        if self.ctx.is_chief:
            atexit.register(self._report_early_exit)

    def _sync(self) -> None:
        self.accelerator.synchronize()

    def _timed(self, kind: str, fn: Any) -> Any:
        session = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            session.calls[kind] += 1
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
    def step(self, steps_completed: int) -> Iterator[None]:
        c = self.contract
        if self.first_step is None:
            self.first_step = steps_completed
        k = steps_completed - self.first_step
        probe = self._start_profile_probe() if c.profile and self.profile is None else None
        flops = self._start_flops() if k == c.start_profile_step - 1 else None
        timed = c.start_profile_step <= k <= c.end_profile_step
        forwards = self.calls["forward"]
        if timed:
            self._sync()
            self.timing = True
            start = time.perf_counter()
        try:
            yield
        except BaseException as err:
            self.timing = False
            with contextlib.suppress(Exception):  # undo the hooks; the step's own error matters
                if flops is not None:
                    flops.end_profile()
                if probe is not None:
                    probe()
            if _is_oom(err):
                self._exit_oom(err)
            raise
        if timed:
            self._sync()
            self.step_s.append(time.perf_counter() - start)
            self.timing = False
            self.micro_steps += self.calls["forward"] - forwards  # micro-batches in this step
        self.last_step = k
        if probe is not None:
            self.profile = probe()
        if flops is not None:
            flops.stop_profile()
            self.flops_per_step = 3.0 * float(flops.get_total_flops())
            flops.end_profile()
        if k >= c.end_profile_step:
            self._finish()

    def _start_flops(self) -> Any:
        from deepspeed.profiling.flops_profiler import FlopsProfiler
        profiler = FlopsProfiler(self.engine.module)
        profiler.start_profile()
        return profiler

    def _start_profile_probe(self) -> Any:
        """Forward hooks on the leaf modules for one step; returns a function ending the probe."""
        import torch
        engine, total, seen = self.engine, [0], set()
        forwards = self.calls["forward"]

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                total[0] += _output_bytes(output, seen)

        leaves = [m for m in engine.module.modules() if next(m.children(), None) is None]
        handles = [m.register_forward_hook(hook) for m in leaves]
        state_bytes = _state_bytes(engine)

        def finish() -> dict[str, Any]:
            for handle in handles:
                handle.remove()
            return _profile_step(self, activation_bytes=total[0], forwards=self.calls["forward"] - forwards,
                                 state_bytes=state_bytes)
        return finish

    def _finish(self) -> None:
        """Reduce the measurements, write the result (chief), end every rank. Never returns."""
        engine, c = self.engine, self.contract
        steps = max(len(self.step_s), 1)
        micro_per_step = self.micro_steps / steps if self.micro_steps else 1.0
        # forward/backward seconds only accumulate while a timed step runs
        local = {"latency": 1000.0 * sum(self.step_s) / steps,
                 "forward": 1000.0 * self.seconds["forward"] / steps,
                 "backward": 1000.0 * self.seconds["backward"] / steps,
                 "flops": self.flops_per_step, "profile": self.profile}
        everyone = self.ctx.all_gather_object(local)
        if self.ctx.is_chief:
            latency = max(r["latency"] for r in everyone)
            samples = micro_per_step * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
            flops = [r["flops"] for r in everyone if r["flops"] is not None]
            metrics = {
                "FLOPS_per_gpu": (sum(flops) / len(flops)) / (latency / 1000.0) if flops and latency > 0 else 0.0,
                "throughput": samples / (latency / 1000.0) if latency > 0 else 0.0,
                "forward": max(r["forward"] for r in everyone),
                "backward": max(r["backward"] for r in everyone),
                "latency": latency,
            }
            profile = _merge_profiles([r["profile"] for r in everyone]) if c.profile else None
            atomic_write_json(c.result_path, {"trial_id": c.trial_id, "status": "ok", "metrics": metrics,
                                         "profile": profile})
            logger.info("dsat trial %d: %s", c.trial_id,
                        ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        self.finished = True
        self.ctx.barrier()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(0)

    def _exit_oom(self, err: BaseException) -> None:
        self.finished = True
        logger.error("dsat trial %d ran out of memory on rank %d: %s", self.contract.trial_id,
                     self.ctx.rank, _oneline(err))
        try:
            _write_oom(self.contract, err)
        finally:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(OOM_EXIT_STATUS)

    def _report_early_exit(self) -> None:
        """atexit, chief only: the loop ended cleanly before end_profile_step."""
        if self.finished or _crashed or os.path.exists(self.contract.result_path):
            return
        c = self.contract
        atomic_write_json(c.result_path, {
            "trial_id": c.trial_id, "status": "failed", "metrics": {}, "profile": None,
            "error": (f"the training loop stopped after {self.last_step + 1} step(s), before "
                      f"end_profile_step={c.end_profile_step}; let the entrypoint run at least "
                      f"{c.end_profile_step + 1} steps with dsat_reporting_context around each")})


def _profile_step(session: _TrialSession, *, activation_bytes: int, forwards: int,
                  state_bytes: int) -> dict[str, Any]:
    """This rank's :class:`ProfileInfo` after the first step.

    * parameters: those this rank holds (the whole model under data parallelism, its stage
      under pipeline parallelism; ZeRO-3's ``ds_numel`` is the full size);
    * activation bytes per example: the bytes of the outputs of every leaf module during the
      step (each storage once: in-place results and views are not counted twice), divided by
      the examples the step processed; deterministic and the same on any device;
    * memory per slot: the GPU's total memory; on CPU the contract's budget, or the host's
      memory divided by the local processes;
    * baseline: on GPU the device memory that PyTorch's allocator does not hold (CUDA context,
      communication buffers); on CPU the peak resident size of the first step minus the bytes of
      the model state tensors (parameters, ZeRO partitions, gradients, optimizer state) and of
      that step's activations. The peak, not the size before the step: the first step itself
      allocates hundreds of MiB that do not grow with the batch (DeepSpeed's first-step buffers,
      kernel workspaces; measured ~600 MiB on the example at micro-batch 1), and the runner
      enforces the budget on the resident size, so the model must count them.
    """
    import torch
    engine, c = session.engine, session.contract
    params = list(engine.module.parameters())
    device = torch.device(getattr(engine, "device", "cpu"))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        memory, baseline = total, max(total - free - torch.cuda.memory_reserved(device), 0)
    else:
        memory = c.memory_per_slot or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                       // max(session.ctx.local_world_size, 1))
        baseline = max(_rss_bytes("VmHWM") - state_bytes - activation_bytes, session.rss_start - state_bytes, 0)
    examples = max(forwards, 1) * engine.train_micro_batch_size_per_gpu()
    half = bool(engine.fp16_enabled() or engine.bfloat16_enabled())
    return ProfileInfo(
        num_params=sum(_numel(p) for p in params),
        trainable_params=sum(_numel(p) for p in params if p.requires_grad),
        activation_bytes_per_example=math.ceil(activation_bytes / examples),
        memory_per_slot=int(memory), baseline_bytes=int(baseline), half_precision=half,
        device="cuda" if device.type == "cuda" else "cpu").to_json()


def _merge_profiles(profiles: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The rank that needs the most memory decides; memory available is the smallest slot's."""
    known = [p for p in profiles if p]
    if not known:
        return None
    merged = dict(known[0])
    for key in ("num_params", "trainable_params", "activation_bytes_per_example", "baseline_bytes"):
        merged[key] = max(p[key] for p in known)
    merged["memory_per_slot"] = min(p["memory_per_slot"] for p in known)
    return merged


def _oneline(err: BaseException) -> str:
    return " ".join(str(err).split())[:500] or type(err).__name__


def _write_oom(contract: TrialContract, err: BaseException) -> None:
    atomic_write_json(contract.result_path, {"trial_id": contract.trial_id, "status": "oom", "metrics": {},
                                        "profile": None, "error": _oneline(err)})


def _install_oom_excepthook() -> None:
    """In a trial process, an uncaught OOM outside any step (``deepspeed.initialize`` placing
    model states that do not fit) is reported as an OOM too; the process then exits as Python
    does (status 1). Installed when this module is imported in a trial, i.e. by ``import toolkit``
    before the model is built."""
    path = os.environ.get(TRIAL_ENV)
    if not path:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        global _crashed
        _crashed = True
        previous(exc_type, exc, tb)
        if isinstance(exc, BaseException) and "torch" in sys.modules and _is_oom(exc):
            with contextlib.suppress(Exception):
                _write_oom(TrialContract.read(path), exc)

    sys.excepthook = hook


_install_oom_excepthook()


def _reset_for_tests() -> None:
    """Forget the memoised environment and session (tests only)."""
    global _trial_file, _session
    _trial_file, _session = _UNSET, None
