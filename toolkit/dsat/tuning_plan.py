"""What the autotuner was asked to do (:class:`Plan`) and the DeepSpeed config of each trial
(:func:`trial_ds_config`, the one place it is made, under the global batch policy). Pure; the
autotuner's process. Example::

    config = trial_ds_config(plan.base_ds_config, spec, data_parallel_size=2, train_batch_size=64)
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_int
from toolkit.bounded_load import load_json
from toolkit.config.deepspeed import (
    BATCH_KEYS,
    overwrite_deepspeed_config,
    resolve_ds_config,
    validate_ds_config,
)
from toolkit.dsat.execution.settings import RunnerSettings
from toolkit.dsat.output_files import EventLog, search_file
from toolkit.dsat.search.batch import GlobalBatch, allowed_micro_batches, global_batch_policy
from toolkit.dsat.search.space import default_zero_autos, offloads_nothing
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec
from toolkit.errors import ConfigError

__all__ = ["CONFIG_SOURCES", "Plan", "as_written", "memory_only", "own_spec", "profile_spec",
           "trial_ds_config"]

TBS, MBS, GAS = BATCH_KEYS
#: Where the search's base config comes from (:attr:`Plan.config_source`): the YAML's
#: ``hyperparameters.deepspeed_config``, DeepSpeed keys written in the hyperparameters, the
#: entrypoint's ``--deepspeed_config`` / ``--deepspeed`` file, or the script itself (built in code:
#: the first profiling trial records it).
CONFIG_SOURCES = ("hyperparameters.deepspeed_config", "hyperparameters", "entrypoint flag", "script")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the autotuner was asked to do, checked before anything is launched; most fields are
    dsat's flags or the experiment's. ``base_ds_config``: the user's DeepSpeed config (file +
    ``overwrite_deepspeed_args``), unresolved, empty while ``awaiting_config`` (the script builds it in
    code and no trial recorded it yet: :meth:`with_base_config`). ``data_parallel_size``:
    ``hyperparameters.data_parallel_world_size`` or ``resources.slots_per_trial``. ``memory_per_slot``:
    the memory model's budget (on GPU the profiling trial's measurement wins). ``global_batch``: the
    policy every trial and the best follow (``global_batch_flag``: ``--global-batch`` as given);
    ``hidden_size`` resolves ZeRO's "auto" sizes; ``confirm``: ``--confirm``; ``config_source``: one of
    :data:`CONFIG_SOURCES`; ``config_flag``: the entrypoint's config flag and path, or None;
    ``own_config``: measure the user's config as written when no trial did."""

    config_path: Path
    experiment: Mapping[str, Any]
    base_ds_config: Mapping[str, Any]
    hparams: Mapping[str, Any]
    data_parallel_size: int
    search: SearchSettings
    runner: RunnerSettings
    output_dir: Path
    resume: bool = False
    run_full_experiment: bool = False
    memory_per_slot: int | None = None
    global_batch: GlobalBatch = GlobalBatch("free")
    hidden_size: int | None = None
    confirm: int = 2
    config_source: str = CONFIG_SOURCES[0]
    config_flag: tuple[str, str] | None = None
    awaiting_config: bool = False
    global_batch_flag: str | int | None = None
    own_config: bool = True

    def with_base_config(self, base: Mapping[str, Any]) -> "Plan":
        """This plan with ``base`` as the user's config, the global batch policy, searched ZeRO section and
        micro-batches derived as the CLI derives them. ConfigError: ``base`` breaks a rule of
        ``validate_ds_config``, or no micro-batch keeps its global batch. Pure."""
        dp, device = self.data_parallel_size, "cpu" if self.runner.gpus is None else "cuda"
        validate_ds_config(as_written(base), device=device, data_parallel_size=dp)
        policy = global_batch_policy(self.global_batch_flag, user_train_batch_size=base.get(TBS))
        kept = policy.train_batch_size
        micro_batches = allowed_micro_batches(kept, data_parallel_size=dp) if kept is not None else None
        first = trial_ds_config(base, profile_spec(base), data_parallel_size=dp, train_batch_size=kept,
                                hidden_size=self.hidden_size)
        validate_ds_config(first, device=device, data_parallel_size=dp)
        zero = base.get("zero_optimization")
        search = dataclasses.replace(self.search, base_zero=dict(zero) if isinstance(zero, Mapping) else {},
                                     micro_batches=micro_batches)
        return dataclasses.replace(self, base_ds_config=copy.deepcopy(dict(base)), global_batch=policy,
                                   search=search, awaiting_config=False)

    def config_line(self) -> str:
        """The search's first line: the convention the entrypoint follows for its config. Pure."""
        merge = ("every trial's tuned keys (micro-batch, accumulation, global batch, zero_optimization) "
                 "are merged over the config the script gives deepspeed.initialize"
                 if self.runner.merge_config else "--no-merge-config: the config the script gives "
                 "deepspeed.initialize is only checked")
        flag = f"{self.config_flag[0]} {self.config_flag[1]}" if self.config_flag else None
        source = {"hyperparameters.deepspeed_config": "hyperparameters.deepspeed_config",
                  "hyperparameters": "the DeepSpeed keys of the hyperparameters",
                  "entrypoint flag": f"the entrypoint's {flag}",
                  "script": "the script itself (no hyperparameters.deepspeed_config, no --deepspeed_config "
                            "or --deepspeed in the entrypoint): the first profiling trial records the config "
                            "it gives deepspeed.initialize"}[self.config_source]
        hf = ("HF Trainer's --per_device_train_batch_size and --gradient_accumulation_steps are set to each "
              "trial's, and the Trainer fills the file's other \"auto\" values; ")
        hf = hf if self.runner.hf_batch_flags else ""
        passed = (f"each trial's own config file replaces {flag} in the entrypoint; {hf}" if flag else
                  "" if self.config_source == "script" else
                  "each trial's config is its hyperparameters' deepspeed_config (toolkit.get_hparams()); ")
        return f"dsat: the search starts from the DeepSpeed config of {source}; {passed}{merge}"

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a search and its ``--resume``."""
        search_settings = {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in dataclasses.asdict(self.search).items()}
        return {"search": json.loads(json.dumps(search_settings, default=str)),
                "base_ds_config": json.loads(json.dumps(self.base_ds_config)),
                "data_parallel_size": self.data_parallel_size,
                "slots_per_trial": self.runner.slots_per_trial,
                "entrypoint": list(self.runner.entrypoint),
                "start_profile_step": self.runner.start_profile_step,
                "end_profile_step": self.runner.end_profile_step,
                "timed_window_s": self.runner.timed_window_s,
                "global_batch": self.global_batch.to_json(), "hidden_size": self.hidden_size,
                "memory_per_slot": self.runner.memory_per_slot,
                **({} if self.runner.merge_config else {"merge_config": False})}

    def allowed_at_most(self, m: int | None) -> int | None:
        """The largest micro-batch the global batch policy allows that is ``<= m`` (None stays None)."""
        allowed = self.search.micro_batches
        if m is None or allowed is None or m < 1:
            return m
        return max(a for a in allowed if a <= m)

    def memory_only(self, spec: TrialSpec) -> bool:
        """:func:`memory_only` under this plan's global batch policy; the first profiling trial
        always when the script builds its config (it ran micro-batch 1 with accumulation 1)."""
        if self.config_source == "script" and spec.profile and spec.trial_id == 0:
            return True
        return memory_only(spec, train_batch_size=self.global_batch.train_batch_size,
                           data_parallel_size=self.data_parallel_size)

    def step_grows_with_micro_batch(self, profiled: TrialResult) -> bool:
        """Whether a timed step's examples grow with the micro-batch: not when the global batch is kept and
        the profiling trial's timed step spanned its accumulation steps (then the trial timeout caps no
        micro-batch: docs/design-dsat-runner.md#the-autotuners-process)."""
        latency = float(profiled.metrics.get("latency") or 0.0)
        micro_per_step = (float(profiled.metrics.get("throughput") or 0.0) * latency / 1000.0
                          / self.data_parallel_size / max(profiled.spec.micro_batch, 1))
        return self.global_batch.train_batch_size is None or micro_per_step <= 1.5

    def resume_problem(self) -> str | None:
        """Why ``--resume`` cannot continue the search recorded in ``output_dir`` (settings other than
        :meth:`fingerprint`'s, or a damaged event log, named with its repair), or None. Reads only."""
        path = search_file(self.output_dir)
        try:
            events = EventLog(self.output_dir / "events.jsonl").read()
            recorded = load_json(path, what="record of the search's settings") if path.exists() else None
        except ConfigError as err:
            where = f"{err.source}: " if err.source else ""
            fix = "" if "events.jsonl" in (err.source or "") else (
                "; it only guards --resume against changed settings: delete it to resume with the current "
                "flags and config, if they are the ones the search was started with")
            return f"--resume: {where}{'; '.join(err.problems)}{fix}"
        stopped = next((e for e in events if e["event"] == "result" and e["result"]["status"] == "mismatch"),
                       None)
        if stopped is not None:
            return (f"--resume: the search in {self.output_dir} stopped at trial {stopped['trial_id']}, "
                    "whose engine ran another config than the trial's; none of its measurements can be "
                    "trusted: start a new search in another --output-dir once the script takes the trial's "
                    "config")
        now = self.fingerprint()
        # a key an earlier toolkit did not record is not checked (memory_per_slot: recorded_budget)
        changed = sorted(k for k in now if k in recorded and recorded[k] != now[k]) if recorded else []
        if not changed:
            return None
        return (f"--resume: the settings differ from the recorded search in {self.output_dir} "
                f"({', '.join(changed)}); resume with the same flags and config")


def recorded_budget(output_dir: Path) -> int | None:
    """The CPU memory budget per slot the search in ``output_dir`` was planned with, or None. ``--resume``
    plans with it again when ``--memory-per-slot`` is not given: the default follows the memory free
    now, and another budget would change the calibration trials and so the replayed search. Reads only."""
    try:
        recorded = load_json(search_file(output_dir), what="record of the search's settings")
    except (ConfigError, OSError):
        return None
    value = recorded.get("memory_per_slot") if isinstance(recorded, dict) else None
    return value if is_int(value) and value > 0 else None


def own_zero(base_ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """The user's own ZeRO section with its stage, as written but for offload sections that move
    nothing (``{"device": "none"}``: the same configuration to DeepSpeed). Pure."""
    zero = base_ds_config.get("zero_optimization")
    zero = copy.deepcopy(dict(zero)) if isinstance(zero, Mapping) else {"stage": int(bool(zero))}
    zero.setdefault("stage", 0)
    return {key: value for key, value in zero.items() if not offloads_nothing(key, value)}


def profile_spec(base_ds_config: Mapping[str, Any]) -> TrialSpec:
    """The profiling trial: micro-batch 1, the user's own ZeRO section (:func:`own_zero`)."""
    return TrialSpec(trial_id=0, micro_batch=1, zero=own_zero(base_ds_config), line=-1, profile=True)


def own_spec(plan: Plan, trial_id: int) -> TrialSpec | None:
    """The user's own config as written (its micro-batch and ZeRO section, labelled ``own``) under the
    plan's global batch policy; None when its micro-batch is unknown ("auto", or not derivable) or
    the policy cannot keep it. Pure."""
    base = plan.base_ds_config
    if not any(isinstance(base.get(k), int) for k in BATCH_KEYS):
        return None
    try:
        resolved = resolve_ds_config(as_written(base), data_parallel_size=plan.data_parallel_size,
                                     hidden_size=plan.hidden_size)
    except ConfigError:
        return None
    mb = resolved.get(MBS)
    allowed = plan.search.micro_batches
    if type(mb) is not int or mb < 1 or (allowed is not None and mb not in allowed):
        return None
    return TrialSpec(trial_id=trial_id, micro_batch=mb, zero=own_zero(base), label="own", baseline=True)


def as_written(base: Mapping[str, Any]) -> dict[str, Any]:
    """The user's config less what dsat fills itself: "auto" batch keys and "auto" ZeRO sizes. Pure."""
    config = copy.deepcopy(dict(base))
    for key in BATCH_KEYS:
        if config.get(key) == "auto":
            del config[key]
    if "zero_optimization" in config:
        config["zero_optimization"] = default_zero_autos(config["zero_optimization"])
    return config


def memory_only(spec: TrialSpec, *, train_batch_size: int | None, data_parallel_size: int) -> bool:
    """Whether trial ``spec`` runs without the kept global batch ``train_batch_size`` (None: free): a
    profiling trial whose micro-batch cannot keep it, or the first (micro-batch 1, whose accumulation
    steps would only slow it: docs/design-dsat-runner.md#the-autotuners-process). Its memory does not
    depend on the accumulation; it is not a result of the search. Pure.

    >>> first = TrialSpec(0, 1, {"stage": 1}, profile=True)
    >>> [memory_only(first, train_batch_size=n, data_parallel_size=2) for n in (768, 2, None)]
    [True, False, False]
    """
    if not spec.profile or train_batch_size is None:
        return False
    per_step = spec.micro_batch * data_parallel_size
    return bool(train_batch_size % per_step) or (spec.trial_id == 0 and train_batch_size > per_step)


def trial_ds_config(base_ds_config: Mapping[str, Any], spec: TrialSpec, *, data_parallel_size: int,
                    train_batch_size: int | None = None, hidden_size: int | None = None) -> dict[str, Any]:
    """The complete DeepSpeed config of a trial (or of the best trial), under the global batch policy;
    the rules: docs/design-dsat-runner.md#the-autotuners-process. Pure."""
    config = overwrite_deepspeed_config(base_ds_config, {MBS: spec.micro_batch})
    config["zero_optimization"] = copy.deepcopy(dict(spec.zero))
    if memory_only(spec, train_batch_size=train_batch_size, data_parallel_size=data_parallel_size):
        train_batch_size, config[GAS] = None, 1
    if train_batch_size is not None:
        config[TBS] = train_batch_size
        config.pop(GAS, None)
    else:
        config.pop(TBS, None)
        if not isinstance(config.get(GAS), int) or isinstance(config.get(GAS), bool):
            config[GAS] = 1
    config = resolve_ds_config(config, data_parallel_size=data_parallel_size, hidden_size=hidden_size)
    config["zero_optimization"] = default_zero_autos(config["zero_optimization"])
    return config
