"""``determined.pytorch.dsat``: what a Core API script calls to be tuned by dsat. Any rank.

Inside a toolkit dsat trial the reporting context measures and ends the trial; elsewhere it is
transparent. How each call differs from Determined's: docs/design-determined.md#dsat-helpers. Example::

    from toolkit.compat.determined.pytorch import dsat     # was: from determined.pytorch import dsat
    ds_config = dsat.get_ds_config_from_hparams(hparams)
    for op in core_context.searcher.operations():
        with dsat.dsat_reporting_context(core_context, op):   # all ranks, around each batch
            loss = engine(x); engine.backward(loss); engine.step()
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Mapping, Sequence

import toolkit
from toolkit._checks import int_problem, is_int, is_mapping, type_name
from toolkit._files import atomic_write
from toolkit.bounded_load import load_json
from toolkit.errors import ConfigError
from toolkit.runtime.trial_env import OUTPUT_DIR_ENV, TRIAL_ENV

__all__ = ["get_ds_config_from_hparams", "dsat_reporting_context", "find_engine",
           "get_batch_config_from_mbs_gas_and_slots", "get_hf_args_with_overwrites"]

logger = logging.getLogger(__name__)

_MODEL_INFO = pathlib.Path("model_info.json")
_AUTOTUNING_METRIC = pathlib.Path("autotuning_metric.json")
_state: dict[str, Any] = {"engine": None, "calls": 0}


def get_ds_config_from_hparams(
    hparams: Mapping[str, Any], base_dir: pathlib.Path | str = pathlib.Path(".")
) -> dict[str, Any]:
    """The JSON named by ``hparams["deepspeed_config"]`` (relative to ``base_dir``) with
    ``overwrite_deepspeed_args`` merged: a new dict, as Determined's. Any rank. Raises ConfigError
    (missing or malformed; Determined asserted) or FileNotFoundError."""
    if "deepspeed_config" not in hparams:
        raise ConfigError(
            "hyperparameters.deepspeed_config is missing: expected the path of the DeepSpeed "
            f"JSON, e.g. 'deepspeed_config: ds_config.json'; found keys {sorted(hparams)}"
        )
    return toolkit.get_ds_config_from_hparams(hparams, base_dir)


def find_engine() -> Any:
    """The process's one DeepSpeed engine (searched once, then cached). Any rank.

    Raises:
        ValueError: none or several engines exist (the context must then be given steps by
            toolkit's own ``toolkit.dsat_reporting_context(engine, steps_completed=...)``).
    """
    engine = _state["engine"]
    if engine is not None:
        return engine
    from deepspeed.runtime.engine import DeepSpeedEngine  # heavy; only inside a trial

    engines = [obj for obj in gc.get_objects() if isinstance(obj, DeepSpeedEngine)]
    if len(engines) != 1:
        raise ValueError(
            f"dsat_reporting_context found {len(engines)} DeepSpeed engines in this process, expected "
            "one (from deepspeed.initialize, created before the first step); with several, use "
            "toolkit.dsat_reporting_context(engine, steps_completed=step)"
        )
    _state["engine"] = engines[0]
    return engines[0]


def _report_autotuning_file(core_context: Any, op: Any, steps_completed: int | None) -> None:
    existing = [p for p in (_MODEL_INFO, _AUTOTUNING_METRIC) if p.exists()]
    if len(existing) != 1:
        return
    steps_completed = op.length if steps_completed is None else steps_completed
    if core_context.distributed.rank == 0:
        results = load_json(existing[0], what="DeepSpeed autotuner metrics file")
        if existing[0] == _MODEL_INFO:
            import torch

            if torch.cuda.is_available():
                results["gpu_mem"] = torch.cuda.get_device_properties(0).total_memory
        core_context.train.report_validation_metrics(steps_completed=steps_completed, metrics=results)
        op.report_completed(results)
    if next(core_context.searcher.operations(), None) is not None:
        raise RuntimeError("Unexpected additional operations found!")


class _ReportingContext:
    """What :func:`dsat_reporting_context` returns: a class, not a generator, since it wraps every
    batch (entering and leaving cost a few microseconds less)."""

    __slots__ = ("_core_context", "_op", "_steps_completed", "_inner")

    def __init__(self, core_context: Any, op: Any, steps_completed: int | None) -> None:
        self._core_context, self._op, self._steps_completed = core_context, op, steps_completed
        self._inner: Any = None

    def __enter__(self) -> None:
        counted = _state["calls"]
        _state["calls"] += 1
        if os.environ.get(TRIAL_ENV):
            steps = counted if self._steps_completed is None else int(self._steps_completed)
            self._inner = toolkit.dsat_reporting_context(find_engine(), steps_completed=steps)
            self._inner.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        inner, self._inner = self._inner, None
        try:
            if inner is not None and inner.__exit__(exc_type, exc, tb):
                return True
        except SystemExit:
            _report_autotuning_file(self._core_context, self._op, self._steps_completed)
            raise
        if exc_type is not None and issubclass(exc_type, SystemExit):
            _report_autotuning_file(self._core_context, self._op, self._steps_completed)
        return False


def dsat_reporting_context(
    core_context: Any, op: Any, steps_completed: int | None = None
) -> contextlib.AbstractContextManager[None]:
    """Wrap one training batch. All ranks. Inside a dsat trial: ``toolkit.dsat_reporting_context`` on the
    process's one engine, ``SystemExit(0)`` on every rank after the last profiled step;
    ``steps_completed`` None counts this context's calls. Outside: Determined's handling of DeepSpeed's
    autotuner exit only (docs/design-determined.md#dsat-helpers)."""
    return _ReportingContext(core_context, op, steps_completed)


def get_batch_config_from_mbs_gas_and_slots(ds_config: Mapping[str, Any], slots: int) -> dict[str, int]:
    """The three batch keys, ``train_batch_size`` = micro-batch x accumulation x ``slots``, as Determined's;
    accumulation 1 when absent or ``"auto"``. Pure; any rank. Raises ConfigError naming every bad value.

    Example:
        >>> get_batch_config_from_mbs_gas_and_slots({"train_micro_batch_size_per_gpu": 4,
        ...                                          "gradient_accumulation_steps": "auto"}, slots=2)
        {'train_batch_size': 8, 'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 1}
    """
    if not is_mapping(ds_config):
        raise ConfigError(f"ds_config={ds_config!r:.80}: expected a DeepSpeed config dict, got "
                          f"{type_name(ds_config)}")
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps", 1)
    gas = 1 if gas == "auto" else gas
    problems = [p for p in (
        int_problem("train_micro_batch_size_per_gpu", mbs, minimum=1),
        int_problem("gradient_accumulation_steps", gas, minimum=1, hint=" or 'auto'"),
        int_problem("slots", slots, minimum=1)) if p]
    if problems or not (is_int(mbs) and is_int(gas)):
        raise ConfigError(problems)
    return {"train_batch_size": mbs * gas * slots, "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": gas}


#: Hugging Face TrainingArguments flags that follow the DeepSpeed config (both spellings).
_HF_BATCH_FLAGS = {"train_micro_batch_size_per_gpu": ("--per_device_train_batch_size",
                                                      "--per-device-train-batch-size"),
                   "gradient_accumulation_steps": ("--gradient_accumulation_steps",
                                                   "--gradient-accumulation-steps")}


def _find_flag(args: Sequence[str], names: Sequence[str]) -> tuple[int, bool] | None:
    """(index, written as ``--flag=value``) of the last occurrence of a flag (argparse's winner)."""
    found = None
    for i, arg in enumerate(args):
        name, eq, _ = arg.partition("=")
        if name in names:
            found = (i, bool(eq))
    return found


def _flag_value(args: Sequence[str], where: tuple[int, bool]) -> str | None:
    i, joined = where
    if joined:
        return args[i].partition("=")[2]
    return args[i + 1] if i + 1 < len(args) else None


def _set_flag(args: list[str], names: Sequence[str], value: str, level: int = logging.WARNING) -> None:
    """Set a flag in place (its last occurrence), or append it; say so at ``level``."""
    where = _find_flag(args, names)
    if where is None:
        logger.log(level, "adding %s %s to the Hugging Face arguments (the DeepSpeed config's value)",
                   names[0], value)
        args += [names[0], value]
        return
    i, joined = where
    old = _flag_value(args, where)
    if old != value:
        logger.log(level, "changing %s from %s to %s to match the DeepSpeed config",
                   args[i].partition("=")[0], old, value)
    if joined:
        args[i] = f"{args[i].partition('=')[0]}={value}"
    elif i + 1 < len(args):
        args[i + 1] = value
    else:
        args.append(value)


def _written_config(config: Mapping[str, Any], beside: pathlib.Path) -> pathlib.Path:
    """``config`` as a JSON file of its own, named by its content (ranks writing it at once write the
    same bytes): in ``TOOLKIT_OUTPUT_DIR`` when set (a dsat trial's own directory), else beside
    the original."""
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    directory = pathlib.Path(os.environ.get(OUTPUT_DIR_ENV) or beside.parent)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{beside.stem}.{digest}.json"
    if not path.exists():
        atomic_write(path, text)
    return path


def _run_config(given: pathlib.Path, named: Any, overwrites: Mapping[str, Any] | None
                ) -> tuple[pathlib.Path, dict[str, Any]] | None:
    """The run's DeepSpeed config file and content, or None when ``--deepspeed``'s file is it."""
    base: pathlib.Path | Mapping[str, Any] = given
    if is_mapping(named):
        base = named
    elif isinstance(named, (str, os.PathLike)) and str(named) and \
            pathlib.Path(named).resolve() != given.resolve():
        base = pathlib.Path(named)  # a dsat trial's own config
    if overwrites is None and isinstance(base, pathlib.Path):
        return None if base == given else (base, toolkit.overwrite_deepspeed_config(base, None))
    config = toolkit.overwrite_deepspeed_config(base, overwrites)
    return _written_config(config, given), config


def get_hf_args_with_overwrites(args: Sequence[str], hparams: Mapping[str, Any]) -> list[str]:
    """Hugging Face arguments (a new list) that follow the run's DeepSpeed config. Any rank; all get the
    same list. The config is ``--deepspeed``'s JSON, or ``hparams["deepspeed_config"]`` when it names
    another (a dsat trial's own), with ``overwrite_deepspeed_args`` merged. As Determined's,
    ``--per_device_train_batch_size`` and ``--gradient_accumulation_steps`` are set (or appended) from
    it, an ``"auto"`` or absent value leaving the flag; unlike Determined's, a merged config goes to a
    new file that ``--deepspeed`` then names (the user's JSON, shared by every trial, is never changed).

    Raises:
        ConfigError: overwrites without ``--deepspeed``, or a config that cannot be merged.
        FileNotFoundError: a named JSON is missing. TypeError: ``args`` is a string.
    """
    if isinstance(args, str):
        raise TypeError(f"args={args!r:.80}: expected a list of arguments such as sys.argv[1:]")
    if not is_mapping(hparams):
        raise ConfigError(f"hparams={hparams!r:.80}: expected a dict of hyperparameters")
    out = list(args)
    overwrites = hparams.get("overwrite_deepspeed_args")
    if overwrites is not None and not is_mapping(overwrites):
        raise ConfigError(f"hyperparameters.overwrite_deepspeed_args={overwrites!r:.80}: expected a mapping "
                          "of DeepSpeed keys to values")
    where = _find_flag(out, ("--deepspeed",))
    given = _flag_value(out, where) if where is not None else None
    if not given:
        if overwrites is not None:
            raise ConfigError("hyperparameters.overwrite_deepspeed_args is set but the Hugging Face "
                              f"arguments {out!r:.200} have no '--deepspeed ds_config.json': add it, "
                              "naming the DeepSpeed JSON")
        return out
    run = _run_config(pathlib.Path(given), hparams.get("deepspeed_config"), overwrites)
    if run is None:
        return out
    path, config = run
    _set_flag(out, ("--deepspeed",), os.fspath(path), logging.INFO)
    for key, names in _HF_BATCH_FLAGS.items():
        value = config.get(key)
        if is_int(value):
            _set_flag(out, names, str(value))
    return out
