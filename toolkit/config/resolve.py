"""Resolve a DeepSpeed config: fill "auto" values and complete the batch triple exactly.

Pure; any rank (every rank computes the same result); the input is never mutated. Every wrong
input, a bad keyword argument such as ``data_parallel_size=0`` included, is one ConfigError.
"""

from __future__ import annotations

from typing import Any, Mapping

from toolkit._checks import int_problem, is_int
from toolkit.config.ds_schema import (
    DS_CONFIG_EXPECTED,
    GAS,
    MBS,
    TBS,
    batch_relation_problem,
    mapping_problem,
    plain_copy,
)
from toolkit.errors import ConfigError

__all__ = ["resolve_ds_config"]

Triple = tuple[int, int, int]


def resolve_ds_config(ds_config: Mapping[str, Any], *, data_parallel_size: int,
                      train_batch_size: int | None = None, micro_batch_size: int | None = None,
                      gradient_accumulation_steps: int | None = None,
                      hidden_size: int | None = None,
                      hparams: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Fill "auto" values and complete the batch triple exactly. Pure; any rank.

    DeepSpeed's rules (``runtime/config.py``) for every combination given, but exact: afterwards
    ``train_batch_size == micro-batch x accumulation x data_parallel_size``, or a ConfigError says
    which numbers break it (DeepSpeed floors the division and trains another batch). A batch key
    missing or "auto" takes its keyword argument; ``hidden_size`` fills ZeRO's model-size "auto"
    values; ``hparams``' ``global_batch_size`` / ``data_parallel_world_size`` must agree. The rules:
    docs/configs.md. ``data_parallel_size`` is world size / (pipeline stages x model parallel size)::

        resolve_ds_config({"train_micro_batch_size_per_gpu": 4}, data_parallel_size=2)  # tbs 8, gas 1
    """
    _check_arguments(ds_config, data_parallel_size=data_parallel_size, hidden_size=hidden_size,
                     hparams=hparams)
    out = plain_copy(ds_config)
    given = _given_batch(out, {TBS: train_batch_size, MBS: micro_batch_size,
                               GAS: gradient_accumulation_steps})
    tbs, mbs, gas = _complete_triple(given, data_parallel_size, found=out)
    out[TBS], out[MBS], out[GAS] = tbs, mbs, gas
    _fill_model_size_autos(out, hidden_size)
    problems = _hparams_agreement(hparams, tbs=tbs, dp=data_parallel_size)
    if problems:
        raise ConfigError(problems)
    return out


def _check_arguments(ds_config: Any, *, data_parallel_size: Any, hidden_size: Any, hparams: Any) -> None:
    """Every problem with the arguments themselves, raised together."""
    found = [mapping_problem(ds_config, "ds_config", DS_CONFIG_EXPECTED),
             int_problem("data_parallel_size", data_parallel_size, minimum=1)]
    if hidden_size is not None and (not is_int(hidden_size) or hidden_size < 1):
        found.append(f"hidden_size={hidden_size!r}: expected a positive integer")
    if hparams is not None:
        found.append(mapping_problem(hparams, "hparams", "a dict of hyperparameters"))
    problems = [problem for problem in found if problem]
    if problems:
        raise ConfigError(problems)


def _positive_or_none(value: Any, key: str, problems: list[str]) -> int | None:
    """``value`` when it is a positive integer; None when absent or "auto"; else a problem."""
    if value is None or value == "auto":
        return None
    if not is_int(value) or value < 1:
        problems.append(f"{key}={value!r}: expected a positive integer")
        return None
    return int(value)


def _given_batch(config: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, int | None]:
    """Each batch key's number from the config or its keyword argument (None when neither)."""
    problems: list[str] = []
    values: dict[str, int | None] = {}
    for key, raw_arg in args.items():
        arg = _positive_or_none(raw_arg, f"argument for {key}", problems)
        current = _positive_or_none(config.get(key), key, problems)
        if current is not None and arg is not None and current != arg:
            problems.append(f"{key}={current} in the config but {arg} was passed; remove one of them")
        values[key] = current if current is not None else arg
    if problems:
        raise ConfigError(problems)
    return values


def _complete_triple(given: Mapping[str, int | None], dp: int, *, found: Mapping[str, Any]) -> Triple:
    """The exact batch triple from what was given, or the ConfigError saying how to fix it."""
    tbs, mbs, gas = given[TBS], given[MBS], given[GAS]
    if tbs is None:
        if mbs is None:
            raise ConfigError(f"neither {TBS} nor {MBS} is given (found {TBS}={found.get(TBS)!r}, "
                              f"{MBS}={found.get(MBS)!r}, {GAS}={found.get(GAS)!r}); set at least one "
                              "of them")
        gas = gas or 1
        return mbs * gas * dp, mbs, gas
    if mbs is None:
        return _from_total(tbs, gas, dp)
    if gas is None:
        if tbs % (mbs * dp):
            raise ConfigError(f"{TBS}={tbs} is not divisible by {MBS}={mbs} x data_parallel_size={dp} "
                              f"= {mbs * dp}; set {TBS} to a multiple of {mbs * dp}, e.g. "
                              f"{max(tbs // (mbs * dp), 1) * mbs * dp}")
        gas = tbs // (mbs * dp)
    problem = batch_relation_problem(tbs, mbs, gas, dp)
    if problem:
        raise ConfigError(problem)
    return tbs, mbs, gas


def _from_total(tbs: int, gas: int | None, dp: int) -> Triple:
    """The triple from ``train_batch_size`` and, when given, the accumulation steps."""
    if gas is not None:
        if tbs % (gas * dp):
            raise ConfigError(f"{TBS}={tbs} is not divisible by {GAS}={gas} x data_parallel_size={dp} "
                              f"= {gas * dp}; set {TBS} to a multiple of {gas * dp}")
        return tbs, tbs // (gas * dp), gas
    if tbs % dp:
        raise ConfigError(f"{TBS}={tbs} is not divisible by data_parallel_size={dp}; set it to a "
                          f"multiple of {dp}, e.g. {max(tbs // dp, 1) * dp}")
    return tbs, tbs // dp, 1


def _fill_model_size_autos(config: dict[str, Any], hidden_size: int | None) -> None:
    """Replace ZeRO's model-size "auto" values in ``config`` (a fresh copy) from ``hidden_size``."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or hidden_size is None:
        return
    fills = {"reduce_bucket_size": hidden_size * hidden_size,
             "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
             "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in fills.items():
        if zero.get(key) == "auto":
            zero[key] = value


def _hparams_agreement(hparams: Mapping[str, Any] | None, *, tbs: int, dp: int) -> list[str]:
    """Determined's ``global_batch_size`` / ``data_parallel_world_size`` against the result."""
    if hparams is None:
        return []
    problems = []
    gbs = hparams.get("global_batch_size")
    if gbs is not None and gbs != tbs:
        problems.append(f"hyperparameters.global_batch_size={gbs!r} but the DeepSpeed config's {TBS} "
                        f"is {tbs}; make them equal")
    dpws = hparams.get("data_parallel_world_size")
    if dpws is not None and dpws != dp:
        problems.append(f"hyperparameters.data_parallel_world_size={dpws!r} but this run has "
                        f"data_parallel_size={dp}; launch {dpws} replicas or change the hyperparameter")
    return problems
