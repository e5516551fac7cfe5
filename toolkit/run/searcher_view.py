"""A ``python -m toolkit.run`` search in TensorBoard: the searcher's run and each trial's HParams.

Beside each trial's own scalars (``<trial dir>/tensorboard``): ``<output_dir>/tensorboard/searcher``,
per trial (step = its index) its metric, whether the searcher stopped it, whether it failed, and
under ASHA the rungs it reached and its metric at each (:func:`searcher_series`), rewritten whole
at each change; and in each trial's directory an HParams session (its values, its validation
metric). Runner process only. Example: ``tensorboard --logdir runs/hp``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_number
from toolkit.run.search_state import SearchState

__all__ = ["SEARCHER_RUN", "flat_hparams", "searcher_series", "write_searcher_view", "write_trial_hparams"]

#: Under the search's output directory: the searcher's run.
SEARCHER_RUN = Path("tensorboard") / "searcher"
_FILE, _HPARAMS = "toolkit-searcher", "toolkit-hparams"


def searcher_series(state: SearchState,
                    config: Mapping[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """The searcher's scalars, ``(trial index, value)`` by tag: ``searcher/metric``,
    ``searcher/stopped_early``, ``searcher/error``; ASHA's ``asha/rungs_reached`` and
    ``asha/<time_metric>_<rung time>`` (a trial's metric at that rung, NaN left out)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for trial in state.trials:
        if is_number(trial.metric):
            series.setdefault("searcher/metric", []).append((trial.index, float(trial.metric)))
        if trial.ended:
            stopped = float(trial.stopped_early)
            series.setdefault("searcher/stopped_early", []).append((trial.index, stopped))
            series.setdefault("searcher/error", []).append((trial.index, float(trial.state == "ERROR")))
    if state.asha is not None:
        searcher = config.get("searcher") or {}
        sign = 1.0 if searcher.get("smaller_is_better", True) else -1.0
        reached: dict[int, int] = {}
        for bracket in state.asha.brackets:
            for rung_time, entries in zip(bracket.rungs, bracket.metrics, strict=True):
                tag = f"asha/{searcher.get('time_metric', 'time')}_{rung_time}"
                for index, value in entries:
                    reached[index] = reached.get(index, 0) + 1
                    if value < sys.float_info.max:  # a metric that was not finite ranks last, not drawn
                        series.setdefault(tag, []).append((index, sign * float(value)))
        started = [t.index for t in state.trials if t.state != "PENDING"]
        series["asha/rungs_reached"] = [(i, float(reached.get(i, 0))) for i in started]
    return series


def write_searcher_view(output_dir: Path, state: SearchState, config: Mapping[str, Any]) -> None:
    """Rewrite the searcher's run from the search state."""
    from toolkit.metrics.tb_events import write_run  # tensorboard is slow to import

    write_run(Path(output_dir) / SEARCHER_RUN, searcher_series(state, config), name=_FILE)


def flat_hparams(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested hyperparameters as HParams columns: ``{"opt.lr": 0.1}``; other values as text. Pure.

    >>> flat_hparams({"opt": {"lr": 0.1}, "layers": [1, 2], "n": 3})
    {'opt.lr': 0.1, 'layers': '[1, 2]', 'n': 3}
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (bool, str)) or (is_number(value) and math.isfinite(value)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def write_trial_hparams(trial_dir: Path, hparams: Mapping[str, Any], *, metric: str | None) -> None:
    """The trial's HParams session in ``trial_dir/tensorboard`` (its metric: the chief's
    ``validation/<metric>`` scalars there), once: a trial's values never change."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries  # slow import

    from toolkit.metrics.tb_events import write_run

    if any((Path(trial_dir) / "tensorboard").glob(f"events.out.tfevents.*.{_HPARAMS}")):
        return
    metrics = {f"validation/{metric}": 0.0} if metric else {}
    summaries = hparams_summaries(flat_hparams(hparams), metrics)
    write_run(Path(trial_dir) / "tensorboard", {}, name=_HPARAMS, purge=False, summaries=summaries)
