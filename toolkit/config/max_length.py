"""``searcher.max_length`` in batches, records or epochs (Determined 0.38's forms), as a number of steps.
Pure; any rank. Re-exported by :mod:`toolkit.config.experiment`."""

from __future__ import annotations

from typing import Any, Mapping

from toolkit._checks import is_int, is_mapping
from toolkit.errors import ConfigError

__all__ = ["max_length_steps", "max_length_unit"]

_UNITS = ("batches", "records", "epochs")


def _max_length(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """(unit, value) of ``searcher.max_length``, None when unset; a ConfigError for any other form."""
    searcher = config.get("searcher") or {}
    if not is_mapping(searcher):
        raise ConfigError(f"searcher={searcher!r}: expected a mapping with metric, smaller_is_better, "
                          "max_length")
    if "max_length" not in searcher:
        return None
    raw = searcher["max_length"]
    unit, value = ("batches", raw)
    if is_mapping(raw) and len(raw) == 1 and next(iter(raw)) in _UNITS:
        unit, value = next(iter(raw.items()))
    if not is_int(value) or value < 1:
        raise ConfigError(f"searcher.max_length={raw!r}: expected a length >= 1 in batches (steps), records "
                          "or epochs, e.g. 500, {batches: 500}, {records: 64000} or {epochs: 2}")
    rpe = config.get("records_per_epoch")
    if rpe is not None and (not is_int(rpe) or rpe < 1):
        raise ConfigError(f"records_per_epoch={rpe!r}: expected an integer >= 1 (the records of one epoch)")
    return str(unit), int(value)


def max_length_unit(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """``searcher.max_length`` as written: (``"batches"``, ``"records"`` or ``"epochs"``, N), or None
    when unset. Pure; any rank; ConfigError for any other form."""
    return _max_length(config)


def _global_batch_size(config: Mapping[str, Any]) -> Any:
    hparams = config.get("hyperparameters") or {}
    value = hparams.get("global_batch_size") if is_mapping(hparams) else None
    if is_mapping(value) and value.get("type") == "const":
        value = value.get("val")
    return value


def max_length_steps(config: Mapping[str, Any], default: int | None = None, *,
                     global_batch_size: int | None = None) -> int | None:
    """``searcher.max_length`` as a number of steps (batches); ``default`` when unset. Pure; any rank.

    Accepts ``500``, ``{batches: 500}``, and Determined 0.38's ``{records: N}`` (``ceil(N / global
    batch size)`` steps) and ``{epochs: N}`` (``N * records_per_epoch`` records). The global batch size
    is ``global_batch_size`` when given (a search trial's), else ``hyperparameters.global_batch_size``.
    ConfigError names any other form, and what converting records or epochs lacks."""
    found = _max_length(config)
    if found is None:
        return default
    unit, value = found
    if unit == "batches":
        return value
    raw = (config.get("searcher") or {})["max_length"]
    problems = []
    records = value
    if unit == "epochs":
        rpe = config.get("records_per_epoch")
        if rpe is None:
            problems.append(f"searcher.max_length={dict(raw)!r}: counting epochs needs records_per_epoch "
                            "(the records of one epoch) at the experiment's top level, e.g. "
                            "records_per_epoch: 50000")
        else:
            records = value * int(rpe)
    gbs = global_batch_size if global_batch_size is not None else _global_batch_size(config)
    if not is_int(gbs) or gbs < 1:
        problems.append(f"searcher.max_length={dict(raw)!r}: counting {unit} needs the global batch size as "
                        f"an integer >= 1: hyperparameters.global_batch_size={gbs!r} (Determined's name); "
                        "set it, or write the length as {batches: N}")
    if problems:
        raise ConfigError(problems)
    return -(-records // int(gbs))
