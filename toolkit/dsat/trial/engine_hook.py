"""Inside a dsat trial: the trial's config reaches ``deepspeed.initialize``, and its engine is checked.

The trial bootstrap (:mod:`toolkit.dsat.trial.site`) wraps ``deepspeed.initialize`` with
:func:`initialize_in_trial`, whether the script imports toolkit or not; under :data:`APPLY_ENV` the
full run merges the best config's keys. Every rank, no collective.
Design: docs/design-dsat-search.md#inside-a-trial.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from toolkit._checks import is_mapping
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.dsat.contract import MISMATCH_EXIT_STATUS, TrialContract
from toolkit.dsat.tuned_keys import (
    config_summary,
    describe_summary,
    engine_summary,
    merge_tuned,
    mismatches,
)
from toolkit.runtime.trial_env import TRIAL_ENV

__all__ = ["APPLY_ENV", "SCRIPT_CONFIG_FILE", "Given", "bootstrap", "check_data_batch", "check_engine",
           "given_config", "initialize_in_trial", "mismatch_text"]

logger = logging.getLogger(__name__)

#: Names the config whose tuned keys a run that is not a trial merges (``--run-full-experiment``).
APPLY_ENV = "TOOLKIT_DSAT_APPLY_CONFIG"
#: In a trial's directory: the config the script gave ``deepspeed.initialize``, as given.
SCRIPT_CONFIG_FILE = "script_config.json"

_checked: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()  # engine -> how given
_own_batch: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # engine -> own mbs


@dataclasses.dataclass(frozen=True)
class Given:
    """How a script gives ``deepspeed.initialize`` its config: ``how`` in words, the config as a
    dict (None: none given, or a path that could not be read) and the path it was read from."""

    how: str
    config: dict[str, Any] | None
    path: str | None = None


def _read(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A config value as DeepSpeed takes it: a dict, a JSON file's path, or base64 of JSON."""
    if is_mapping(value):
        return copy.deepcopy(dict(value)), None
    if not isinstance(value, (str, os.PathLike)):
        return None, None
    text = os.fspath(value)
    if os.path.isfile(text):
        return load_json(text, what="DeepSpeed config"), os.path.abspath(text)
    with contextlib.suppress(ValueError, UnicodeDecodeError):  # DeepSpeed's autotuner passes base64
        decoded = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
        if isinstance(decoded, dict):
            return decoded, None
    return None, text


def given_config(bound: Mapping[str, Any]) -> Given:
    """The config of a ``deepspeed.initialize`` call's bound arguments, by DeepSpeed's rules
    (``deepspeed/__init__.py``): ``config``, else ``config_params``, else ``args.deepspeed_config``
    (``--deepspeed_config``; ``deepscale_config`` is its old name). Reads a file; any rank."""
    args = bound.get("args")
    for name in ("config", "config_params"):
        if bound.get(name) is not None:
            config, path = _read(bound[name])
            kind = "a dict" if is_mapping(bound[name]) else f"the file {path}"
            return Given(f"{kind} given as deepspeed.initialize({name}=...)", config, path)
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None)
        if value is not None:
            config, path = _read(value)
            return Given(f"args.{attr}={os.fspath(value)!r} (the --{attr} flag) given as "
                         "deepspeed.initialize(args=args)", config, path)
    return Given("no config given to deepspeed.initialize", None)


def bootstrap() -> None:
    """Inside a trial, once DeepSpeed is imported (idempotent): the OOM excepthook, py-cpuinfo's answer
    and DeepSpeed's op-build guards, also for a script that never imports toolkit. Every rank."""
    from toolkit.dsat.trial.cpu_info import install_from_env
    from toolkit.runtime import op_builds
    from toolkit.runtime.trial_oom import install_oom_excepthook
    install_oom_excepthook()
    install_from_env()
    guards = getattr(op_builds, "install_build_guards", None)
    if callable(guards):
        guards()


def _is_chief() -> bool:
    from toolkit.runtime.launch_env import detect_launch
    try:
        return detect_launch().rank == 0
    except Exception:  # noqa: BLE001 (a malformed launch is the script's own error to meet)
        return True


def _trial_contract() -> TrialContract | None:
    from toolkit.dsat.trial.session import read_contract
    path = os.environ.get(TRIAL_ENV)
    return read_contract(path) if path else None


def _with_config(bound: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments with ``config`` as ``config=``: ``config_params`` and the copy of
    ``args``'s config attributes set to None. The script's ``args`` object is not changed."""
    out = dict(bound, config=config, config_params=None)
    args = bound.get("args")
    if any(getattr(args, a, None) is not None for a in ("deepspeed_config", "deepscale_config")):
        args = copy.copy(args)
        for attr in ("deepspeed_config", "deepscale_config"):
            if getattr(args, attr, None) is not None:
                setattr(args, attr, None)
        out["args"] = args
    return out


def initialize_in_trial(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``deepspeed.initialize`` (``original``) in a trial (record, merge, check, time the engine's
    steps) or a full run with :data:`APPLY_ENV` (merge only); elsewhere ``original`` unchanged. Every rank."""
    contract = _trial_contract()
    apply_path = os.environ.get(APPLY_ENV)
    if contract is None and not apply_path:
        return original(*args, **kwargs)
    if contract is not None:
        bootstrap()  # done at DeepSpeed's import unless toolkit was being imported then
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # DeepSpeed's own error for the call
    arguments = dict(bound.arguments)
    given = given_config(arguments)
    path = contract.ds_config if contract is not None else apply_path
    target = load_json(path, what="dsat's DeepSpeed config") if path else None  # None: a contract naming none
    chief = _is_chief()
    if contract is not None and target is not None and chief:
        _record(contract, given, target)
    merge = contract.merge_config if contract is not None else True
    if merge and target is not None and given.config != target:
        merged = _merged(given, target, trial=contract is not None)
        if merged is not None:
            arguments = _with_config(arguments, merged)
            if chief:
                logger.warning("dsat %s: merged its tuned keys (%s) over %s", _who(contract),
                               describe_summary(config_summary(target)), given.how)
    result = original(**arguments)
    engine = result[0] if isinstance(result, tuple) and result else result
    if contract is not None:
        with contextlib.suppress(TypeError):  # an engine that cannot be weakly referenced: no data-limit rule
            _own_batch[engine] = (given.config or {}).get("train_micro_batch_size_per_gpu")
        check_engine(engine, contract, how=given.how, merged=merge)
        from toolkit.dsat.trial.engine_steps import time_engine_steps
        time_engine_steps(engine, os.environ[TRIAL_ENV])
    return result


def _merged(given: Given, target: Mapping[str, Any], *, trial: bool) -> dict[str, Any] | None:
    """What the engine gets: the tuned keys over the script's config; the whole of ``target`` when
    the script gives none; None (the call as the script made it) when its file could not be read."""
    if given.config is not None:
        return merge_tuned(given.config, target, instrumented=trial)
    return copy.deepcopy(dict(target)) if given.path is None else None


def _who(contract: TrialContract | None) -> str:
    return f"trial {contract.trial_id}" if contract is not None else "full run"


def _record(contract: TrialContract, given: Given, target: Mapping[str, Any]) -> None:
    """Chief: the config as the script gave it, in the trial's directory, for the autotuner (the
    config it plans from when it knows none, and the base of the best config it writes)."""
    own = contract.ds_config
    same = given.config == dict(target) or (given.path is not None and own is not None
                                            and os.path.abspath(given.path) == os.path.abspath(own))
    atomic_write_json(Path(contract.result_path).parent / SCRIPT_CONFIG_FILE,
                      {"how": given.how, "path": given.path, "source": "trial" if same else "script",
                       "config": given.config}, default=str)


def check_engine(engine: Any, contract: TrialContract, *, how: str | None, merged: bool) -> None:
    """Hold the engine's micro-batch, accumulation, ZeRO stage and offload to the trial's config, once
    per engine; a difference ends the trial (:func:`end_on_mismatch`). ``how``: None when
    ``deepspeed.initialize`` was not seen. Every rank."""
    if contract.ds_config is None or engine in _checked:
        return
    _checked[engine] = how
    expected = config_summary(load_json(contract.ds_config, what="trial's DeepSpeed config"))
    actual = engine_summary(engine)
    problems = mismatches(actual, expected)
    if problems:
        end_on_mismatch(contract, problems, actual=actual, expected=expected, how=how, merged=merged)


def check_data_batch(engine: Any, contract: TrialContract, sizes: set[int]) -> None:
    """At the first backward: the last forward's examples against the engine's micro-batch
    (:func:`data_batch_verdict`); a loader of its own ends the trial as ``"mismatch"``, a data set
    short of the micro-batch as ``"failed"``. Every rank."""
    if not sizes:
        return
    actual = engine_summary(engine)
    verdict = data_batch_verdict(sizes, micro_batch=actual["micro_batch"], own=_own_batch.get(engine))
    if verdict is None:
        return
    fed = "/".join(map(str, sorted(sizes)))
    if verdict == "failed":
        _end(contract, f"its loop feeds {fed} examples per forward, fewer than micro-batch "
             f"{actual['micro_batch']}: the data set (per rank) is smaller than the micro-batch, so this "
             "micro-batch cannot be measured with this data (a larger data set measures it)",
             {"engine": actual, "data_batch": sorted(sizes), "data_limit": max(sizes)}, status="failed")
    text = (f"its loop feeds {fed} examples per forward (the input's first dimension) to an engine that runs "
            f"micro-batch {actual['micro_batch']}, so its throughput would be counted for examples it never "
            f"trained. The script's config: {_checked.get(engine) or 'not seen'}. Fix: let the data loader "
            "take its batch size from engine.train_micro_batch_size_per_gpu() (or DeepSpeed's "
            "training_data=), not a size of its own")
    _end(contract, text, {"engine": actual, "data_batch": sorted(sizes)})


def data_batch_verdict(sizes: set[int], *, micro_batch: int, own: Any) -> str | None:
    """None when a forward's example counts ``sizes`` hold the engine's ``micro_batch`` (or none was
    seen); ``"failed"`` when all are smaller and none is the script's own micro-batch ``own`` (the loader
    follows the config but the data set runs short); else ``"mismatch"``. Pure.

    >>> data_batch_verdict({2}, micro_batch=64, own=2), data_batch_verdict({30}, micro_batch=40, own=40)
    ('mismatch', 'failed')
    """
    if not sizes or micro_batch in sizes:
        return None
    if own is not None and own not in sizes and max(sizes) < micro_batch:
        return "failed"
    return "mismatch"


def mismatch_text(problems: list[str], *, actual: Mapping[str, Any], expected: Mapping[str, Any],
                  how: str | None, merged: bool, trial_config: str) -> str:
    """The mismatch in words: both configs, how the script takes its config, and the fix. Pure."""
    given = how or ("deepspeed.initialize was not seen: the engine was built another way, or the trial "
                    "bootstrap was not loaded (a python started with -S or -I, or a PYTHONPATH reset)")
    kept = "dsat merged the trial's keys over it" if merged else "--no-merge-config kept it as written"
    return (f"its engine runs another config than the trial's ({'; '.join(problems)}). The engine: "
            f"{describe_summary(actual)}; the trial's config ({trial_config}): {describe_summary(expected)}. "
            f"The script's config: {given}; {kept}. Fix: let the trial's config reach the engine: "
            "pass it with --deepspeed_config in the entrypoint and deepspeed.initialize(args=args), build "
            "it with toolkit.get_ds_config_from_hparams(toolkit.get_hparams()), or give "
            "deepspeed.initialize your config and let dsat merge the trial's keys (no --no-merge-config); "
            "no measurement of this search can be trusted until then")


def end_on_mismatch(contract: TrialContract, problems: list[str], *, actual: Mapping[str, Any],
                    expected: Mapping[str, Any], how: str | None, merged: bool) -> NoReturn:
    """Write the trial's ``"mismatch"`` result and end this process with :data:`MISMATCH_EXIT_STATUS`.
    Every rank that sees it (each writes the same result, atomically); ``os._exit``, no teardown."""
    text = mismatch_text(problems, actual=actual, expected=expected, how=how, merged=merged,
                         trial_config=str(contract.ds_config))
    _end(contract, text, {"engine": dict(actual), "expected": dict(expected)})


def _end(contract: TrialContract, text: str, record: Mapping[str, Any], *,
         status: str = "mismatch") -> NoReturn:
    """End the trial with ``status`` (``"failed"``: a config this script's data cannot measure, exit 0)."""
    logger.error("dsat trial %d: %s", contract.trial_id, text)
    try:
        atomic_write_json(contract.result_path, {"trial_id": contract.trial_id, "status": status,
                                                 "metrics": {}, "profile": None, **record, "error": text})
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(MISMATCH_EXIT_STATUS if status == "mismatch" else 0)
