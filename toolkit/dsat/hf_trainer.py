"""HF Trainer's DeepSpeed convention in dsat's trials: ``--deepspeed ds_config.json`` in the entrypoint,
a config file with ``"auto"`` values that the Trainer fills from its own flags before DeepSpeed sees it.

The Trainer takes its micro-batch and accumulation from ``--per_device_train_batch_size`` and
``--gradient_accumulation_steps``, sizes its data loader from the first, and refuses a config whose
batch keys contradict them. So a trial of such a script gets both flags set to its own values, and
its file keeps the user's ``"auto"`` values for the Trainer to fill; ``train_batch_size`` is left out
(DeepSpeed derives it from the two and the ranks). Pure functions; the autotuner's process (rank 0)::

    python -m toolkit.dsat binary hf.yaml .    # entrypoint: python3 train.py --deepspeed ds.json ...
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from toolkit._checks import is_int, is_mapping
from toolkit.config.ds_schema import BATCH_KEYS
from toolkit.config.validate import find_auto
from toolkit.errors import ConfigError

__all__ = ["ACCUMULATION_FLAG", "MICRO_BATCH_FLAG", "batch_flags_line", "hf_base_config", "hf_trial_config",
           "is_hf_trainer", "with_batch_flags", "without_autos"]

TBS, MBS, GAS = BATCH_KEYS
MICRO_BATCH_FLAG = "--per_device_train_batch_size"
ACCUMULATION_FLAG = "--gradient_accumulation_steps"
#: The Trainer's defaults for the two flags (``TrainingArguments``).
_DEFAULTS = {MICRO_BATCH_FLAG: 8, ACCUMULATION_FLAG: 1}


def _flag_value(entrypoint: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``entrypoint`` (argparse keeps the last)."""
    found = None
    words = list(entrypoint)
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith(flag + "="):
            found = word[len(flag) + 1:]
    return found


def is_hf_trainer(flag: tuple[str, str] | None, entrypoint: Sequence[str],
                  file_config: Mapping[str, Any]) -> bool:
    """Whether the entrypoint follows HF Trainer's convention: its config flag is ``--deepspeed PATH``
    and either the file holds an ``"auto"`` (DeepSpeed alone cannot run it; the Trainer fills it) or
    the entrypoint sets one of the Trainer's batch flags.

    >>> is_hf_trainer(("--deepspeed", "ds.json"), ["python3", "t.py"], {"gradient_clipping": "auto"})
    True
    >>> is_hf_trainer(("--deepspeed_config", "ds.json"), ["python3", "t.py"], {"gradient_clipping": "auto"})
    False
    """
    if flag is None or flag[0] != "--deepspeed":
        return False
    return bool(find_auto(file_config)) or any(_flag_value(entrypoint, f) is not None for f in _DEFAULTS)


def hf_base_config(file_config: Mapping[str, Any], entrypoint: Sequence[str]) -> dict[str, Any]:
    """The user's file as the Trainer fills its batch keys: an ``"auto"`` micro-batch or accumulation
    takes its flag's value from the entrypoint (the Trainer's default when the flag is absent), an
    ``"auto"`` ``train_batch_size`` is left out (DeepSpeed derives it); other ``"auto"`` values stay.
    A new dict. ConfigError: a flag's value is not a positive integer."""
    config = copy.deepcopy(dict(file_config))
    problems = []
    for key, flag in ((MBS, MICRO_BATCH_FLAG), (GAS, ACCUMULATION_FLAG)):
        if config.get(key) != "auto":
            continue
        raw = _flag_value(entrypoint, flag)
        try:
            value = int(raw) if raw is not None else _DEFAULTS[flag]
        except ValueError:
            value = 0
        if value < 1:
            problems.append(f"the entrypoint's {flag} {raw!r}: expected a positive integer (it fills the "
                            f"DeepSpeed config's \"auto\" {key})")
        config[key] = value
    if problems:
        raise ConfigError(problems)
    if config.get(TBS) == "auto":
        del config[TBS]
    return config


def without_autos(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without its ``"auto"`` values: what DeepSpeed gets once the Trainer filled them with
    values of its own (the rules of those values are the Trainer's). A new dict.

    >>> without_autos({"gradient_clipping": "auto", "optimizer": {"params": {"lr": "auto", "eps": 1e-8}}})
    {'optimizer': {'params': {'eps': 1e-08}}}
    """
    return {k: without_autos(v) if is_mapping(v) else copy.deepcopy(v)
            for k, v in config.items() if v != "auto"}


def hf_trial_config(config: Mapping[str, Any], *, data_parallel_size: int) -> dict[str, Any]:
    """A trial's (or the best) config in the Trainer's shape: micro-batch and accumulation given, no
    ``train_batch_size`` (the Trainer would check it against a world size of its own, 1 on CPU). A new dict.

    >>> hf_trial_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, data_parallel_size=2)
    {'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 2}
    """
    out = copy.deepcopy(dict(config))
    mbs, tbs = out.get(MBS), out.pop(TBS, None)
    if is_int(tbs) and is_int(mbs) and mbs >= 1:
        out[GAS] = max(1, int(tbs) // (int(mbs) * data_parallel_size))
    elif not is_int(out.get(GAS)):
        out[GAS] = 1
    return out


def with_batch_flags(entrypoint: Sequence[str], config: Mapping[str, Any]) -> list[str]:
    """``entrypoint`` (a new list) with the Trainer's two batch flags set to ``config``'s micro-batch and
    accumulation: each flag's words replaced where it is given, appended where it is not.

    >>> with_batch_flags(["python3", "t.py", "--per_device_train_batch_size", "4"],
    ...                  {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2})
    ['python3', 't.py', '--per_device_train_batch_size', '16', '--gradient_accumulation_steps', '2']
    """
    words = list(entrypoint)
    for flag, key in ((MICRO_BATCH_FLAG, MBS), (ACCUMULATION_FLAG, GAS)):
        value = str(config[key])
        given = False
        for i, word in enumerate(words):
            if word == flag and i + 1 < len(words):
                words[i + 1], given = value, True
            elif word.startswith(flag + "="):
                words[i], given = f"{flag}={value}", True
        if not given:
            words += [flag, value]
    return words


def batch_flags_line(config: Mapping[str, Any]) -> str:
    """How to run the best config with the Trainer: its two batch flags. Pure.

    >>> line = batch_flags_line({"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1})
    >>> line.split("best_ds_config.json ")[1]
    '--per_device_train_batch_size 16 --gradient_accumulation_steps 1'
    """
    return (f"HF Trainer: run it with --deepspeed best_ds_config.json {MICRO_BATCH_FLAG} {config[MBS]} "
            f"{ACCUMULATION_FLAG} {config[GAS]}")
