"""The script's own DeepSpeed config, as its trials recorded it: the search's base when the script
builds it in code, the base of the best config written, and the user's config measured beside the best.

A trial's chief writes ``trials/trial_<id>/script_config.json`` at ``deepspeed.initialize``
(:mod:`toolkit.dsat.trial.engine_hook`). Rank 0 only (the autotuner's process); reads files, writes
nothing. Example::

    plan = discovered_plan(plan, out, first_result)     # after p1 of a script that builds its config
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from toolkit._checks import is_mapping
from toolkit.bounded_load import load_json
from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.types import SMALLER_IS_BETTER, TrialResult, TrialSpec
from toolkit.dsat.trial.engine_hook import SCRIPT_CONFIG_FILE
from toolkit.dsat.tuned_keys import merge_tuned, strip_instrumentation
from toolkit.dsat.tuning_plan import Plan, own_zero
from toolkit.errors import ConfigError

__all__ = ["NO_CONFIG", "best_config", "discovered_plan", "own_comparison", "recorded"]

#: Why a search cannot start from a script's config, and the three ways to give dsat one.
NO_CONFIG = ("dsat needs the DeepSpeed config your script trains with. Give it one of three ways "
             "(docs/dsat.md): (1) --deepspeed_config ds_config.json in the entrypoint, read by "
             "deepspeed.add_config_arguments and deepspeed.initialize(args=args); (2) a config your script "
             "gives deepspeed.initialize(config=...), a dict or a file, which the first profiling trial "
             "records (the script must call deepspeed.initialize in the trial's process, with Python's "
             "site module on); (3) hyperparameters.deepspeed_config: ds_config.json in the YAML, read with "
             "toolkit.get_ds_config_from_hparams(toolkit.get_hparams())")


def recorded(out: Path, trial_id: int) -> dict[str, Any] | None:
    """The config trial ``trial_id``'s script gave ``deepspeed.initialize`` when it was the script's
    own (not the trial's file handed back); None otherwise or when nothing was recorded."""
    path = out / "trials" / f"trial_{trial_id}" / SCRIPT_CONFIG_FILE
    if not path.exists():
        return None
    try:
        record = load_json(path, what="the script's recorded DeepSpeed config")
    except (OSError, ConfigError):
        return None
    config = record.get("config") if isinstance(record, dict) else None
    return dict(config) if is_mapping(config) and record.get("source") == "script" else None


def discovered_plan(plan: Plan, out: Path, first: TrialResult) -> tuple[Plan, TrialResult]:
    """After the first profiling trial of a script that builds its config: the plan with that
    config as its base, and the trial labelled with the script's own ZeRO section.

    Raises:
        ConfigError: nothing was recorded (:data:`NO_CONFIG`), or the config breaks a rule of
            ``validate_ds_config`` (naming the file it was recorded in).
    """
    config = recorded(out, first.spec.trial_id)
    where = out / "trials" / f"trial_{first.spec.trial_id}" / SCRIPT_CONFIG_FILE
    if config is None:
        raise ConfigError(f"trial {first.spec.name} ran, but no config given to deepspeed.initialize by the "
                          f"script was recorded ({where}): {NO_CONFIG}")
    try:
        new = plan.with_base_config(config)
    except ConfigError as err:
        raise ConfigError([f"the config your script gives deepspeed.initialize: {p}" for p in err.problems],
                          source=str(where)) from None
    return new, dataclasses.replace(first, spec=dataclasses.replace(first.spec, zero=own_zero(config)))


def best_config(out: Path, spec: TrialSpec, trial_config: Mapping[str, Any],
                user_config: Mapping[str, Any]) -> dict[str, Any]:
    """The best config to write: the script's own config (as the best trial recorded it) with the
    tuned keys of ``trial_config`` merged, ready for ``--deepspeed_config``; ``trial_config`` when
    the trial's script took dsat's file as it was."""
    script = recorded(out, spec.trial_id)
    if script is None:
        return dict(trial_config)
    return strip_instrumentation(merge_tuned(script, trial_config, instrumented=False), user_config)


def own_comparison(own: Sequence[TrialResult], best: TrialResult, metric: str) -> tuple[str, dict[str, Any]]:
    """The line comparing the best with the user's own config's measurements (``own``: the trials
    of that configuration), and its record for ``best_ds_metrics.json``. Pure."""
    if not own:
        return "", {}
    spec = own[0].spec
    values = [float(r.metrics[metric]) for r in own if r.status is TrialStatus.OK and metric in r.metrics]
    names = ", ".join(r.spec.name for r in own)
    record: dict[str, Any] = {"micro_batch": spec.micro_batch, "stage": spec.stage, "trials": names,
                              "statuses": [r.status.value for r in own], "value": None, "factor": None}
    head = f"your own config (stage {spec.stage}, micro-batch {spec.micro_batch}; trial {names})"
    if not values:
        return f"{head}: {', '.join(sorted({r.status.value for r in own}))}, no {metric} measured", record
    value = statistics.median(values)
    best_value = float(best.metrics[metric])
    factor = None
    if value > 0 and best_value > 0:
        factor = value / best_value if metric in SMALLER_IS_BETTER else best_value / value
    record.update(value=value, factor=factor)
    better = f"; the best is {factor:.3g}x as good" if factor is not None else ""
    if any(r.spec.trial_id == best.spec.trial_id for r in own):
        better = "; the best is your own config"
    return f"{head}: {metric} = {value:.4g}, the best's {best_value:.4g}{better}", record
