"""How a dsat trial ended, decided from its exit status and its result file, never from its logs.

Called by :mod:`toolkit.dsat.execution.runner` once a trial's processes are gone, with the
runner's own verdict (timeout, memory budget) when it has one. Autotuner process only. The
decision table: docs/design-dsat-runner.md#how-a-trial-ended.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
from pathlib import Path
from typing import Any

from toolkit._checks import is_number
from toolkit.bounded_load import load_json
from toolkit.checkpoint.stop_record import STOP_FILE, read_stop_record
from toolkit.dsat.contract import METRICS, ProfileInfo, TrialStatus, clip_error
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.dsat.tuned_keys import SUMMARY_NAMES, config_summary, mismatches
from toolkit.errors import CheckpointError, ConfigError
from toolkit.launch.output import TRIAL_LOG, ranks_lines

__all__ = ["LAUNCHER_ONLY_VARIABLES", "TrialPreempted", "check_result", "classify", "exit_text",
           "launcher_hint", "preemption_of", "stderr_tail"]

logger = logging.getLogger(__name__)

_STDERR_LINES = 5
#: The largest result file read (a trial's error text is then cut to ``MAX_ERROR_CHARS``).
MAX_RESULT_BYTES = 256 * 2**20
# The launcher's own epilogue (torchrun's ChildFailedError table) hides the worker's error.
_LAUNCHER_EPILOGUE = ("] failed (exitcode:", "ChildFailedError", "exits with return code")
#: Variables that one of dsat's local launchers sets for each rank and the other does not
#: (deepspeed/launcher/launch.py; torch.distributed.run).
LAUNCHER_ONLY_VARIABLES = {"deepspeed": ("LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"),
                           "torchrun": ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")}
# A line reporting a missing variable: toolkit's LaunchEnvError ("X, Y not set"), a KeyError of
# os.environ, or the word "missing" (a malformed value, "X='a' is not an integer", is not one).
_MISSING = re.compile(r"not set|KeyError|missing", re.IGNORECASE)


class TrialPreempted(KeyboardInterrupt):
    """A trial stopped for a preemption (its ranks wrote the stop record) before its result: not a failed
    configuration. dsat stops as when interrupted (exit 130); ``--resume`` runs the trial again."""


def preemption_of(directory: Path) -> str | None:
    """Why the trial in ``directory`` stopped, when it stopped for a preemption before writing its
    result (its ``TOOLKIT_STOP_RECORD``, :mod:`toolkit.checkpoint.stop_record`); else None."""
    if (directory / "result.json").exists() or not (directory / STOP_FILE).exists():
        return None
    try:
        record = read_stop_record(directory / STOP_FILE)
    except CheckpointError as err:
        return f"a damaged stop record ({err})"
    return None if record is None else record.cause


def exit_text(code: int | None) -> str:
    """``"exit status N"`` or ``"killed by signal SIGX"`` for a Popen return code (None: not reaped). Pure."""
    if code is None:
        return "its launcher had not exited by the end of the kill grace period"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def stderr_tail(path: Path) -> str:
    """The last lines of a trial's log before its launcher's epilogue, as a suffix for an error
    (``""`` if none). ``path``: the log, or the trial's directory (:func:`_read_tail`)."""
    text = _read_tail(path)
    lines = [line.rstrip()[:300] for line in text.splitlines() if line.strip()]
    # The launcher's own epilogue (torchrun's ChildFailedError table) hides the worker's error.
    ends = [i for i, line in enumerate(lines) if any(m in line for m in _LAUNCHER_EPILOGUE)]
    if ends and ends[0] > 0:
        lines = lines[:ends[0]]
    lines = lines[-_STDERR_LINES:]
    return ("\nlast lines of its output:\n  " + "\n  ".join(lines)) if lines else ""


def _read_tail(path: Path) -> str:
    """The end of a log; of a trial's directory, its ranks' lines in ``trial.log`` (``stderr.log``
    where there is none)."""
    if path.is_dir():
        if (path / TRIAL_LOG).exists():
            return ranks_lines(_read_tail(path / TRIAL_LOG))
        path = path / "stderr.log"
    try:
        with open(path, "rb") as fh:
            fh.seek(max(fh.seek(0, os.SEEK_END) - 16384, 0))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def launcher_hint(text: str) -> str:
    """The sentence naming ``--launcher X`` when ``text`` (a trial's stderr tail) says variables only
    launcher X sets are missing; ``""`` otherwise. Pure.

    >>> launcher_hint("LOCAL_SIZE, CROSS_RANK, CROSS_SIZE not set: ...")[-44:]
    'torchrun does not: pass --launcher deepspeed'"""
    named: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not _MISSING.search(line):
            continue
        for launcher, candidates in LAUNCHER_ONLY_VARIABLES.items():
            for name in candidates:
                if re.search(rf"(?<![A-Z_]){name}(?![A-Z_])", line) and name not in named.get(launcher, []):
                    named.setdefault(launcher, []).append(name)
    if len(named) != 1:  # none, or both launchers' variables: no single flag fixes it
        return ""
    (launcher, missing), = named.items()
    other = next(name for name in LAUNCHER_ONLY_VARIABLES if name != launcher)
    return (f": the script reads {', '.join(missing)}, which the {launcher} launcher sets and {other} "
            f"does not: pass --launcher {launcher}")


def check_result(data: Any, spec: TrialSpec) -> str | None:
    """What is wrong with a result file's content (parsed JSON) for ``spec``, or None. Pure."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    if data.get("trial_id") != spec.trial_id:
        return f"trial_id={data.get('trial_id')!r}, expected {spec.trial_id}"
    status = data.get("status")
    if status not in ("ok", "oom", "failed", "mismatch"):
        return f"status={status!r}, expected 'ok', 'oom', 'failed' or 'mismatch'"
    engine = data.get("engine")
    if engine is not None and not (isinstance(engine, dict) and set(engine) <= set(SUMMARY_NAMES)):
        return f"engine={engine!r:.200}: expected an object with {', '.join(SUMMARY_NAMES)}"
    limit = data.get("data_limit")
    if limit is not None and (type(limit) is not int or limit < 1):
        return f"data_limit={limit!r:.60}: expected an integer >= 1 or none"
    if status != "ok":
        return None
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        return f"metrics={metrics!r:.80}, expected an object with {', '.join(METRICS)}"
    for name in METRICS:
        value: Any = metrics.get(name)  # parsed JSON
        if not is_number(value) or not math.isfinite(value) or value < 0:
            return f"metric {name}={value!r}: expected a finite number >= 0"
    profile: Any = data.get("profile")
    if spec.profile or profile is not None:
        problem = ProfileInfo.problem(profile)
        if problem is not None:
            return f"profile={profile!r:.200}: {problem}"
    return None


def _engine_mismatch(engine: Any, ds_config: Path) -> str:
    """How the engine a result reports differs from the trial's config file; ``""`` when it does not,
    or when either is missing (a result of a script that times itself carries no engine)."""
    if not isinstance(engine, dict) or not ds_config.exists():
        return ""
    try:
        expected = config_summary(load_json(ds_config, what="trial's DeepSpeed config"))
    except (OSError, ConfigError):
        return ""
    return "; ".join(mismatches(engine, expected))


def classify(spec: TrialSpec, *, directory: Path, code: int | None, duration_s: float,
             verdict: tuple[TrialStatus, str] | None = None) -> TrialResult:
    """How a trial ended: the runner's ``verdict`` (timeout, memory budget) first, else its exit status
    ``code`` (None: not reaped in the grace period) and ``directory/result.json``. A FAILED error ends
    with the tail of the trial's log, for display only. Autotuner process only."""
    def result(status: TrialStatus, error: str | None = None, **kw: Any) -> TrialResult:
        if status is TrialStatus.FAILED and error is not None:
            error += launcher_hint(_read_tail(directory))
            error += stderr_tail(directory)
        logger.info("trial %s ended: %s%s", spec.name, status.value, f" ({error})" if error else "")
        return TrialResult(spec, status, duration_s=duration_s, error=error, **kw)

    if verdict is not None:
        return result(*verdict)
    path = directory / "result.json"
    if not path.exists():
        return result(TrialStatus.FAILED, "exited 0 without a result file" if code == 0 else exit_text(code))
    try:
        data = load_json(path, max_bytes=MAX_RESULT_BYTES, what="result file")
    except OSError as err:
        return result(TrialStatus.FAILED, f"corrupt result file: {err}")
    except ConfigError as err:
        return result(TrialStatus.FAILED, clip_error(f"corrupt result file: {'; '.join(err.problems)}"))
    problem = check_result(data, spec)
    if problem is not None:
        return result(TrialStatus.FAILED, f"corrupt result file: {problem}")
    own = clip_error(str(data.get("error") or ""), where=str(path)) or None  # the trial's own words, cut
    if data["status"] == "mismatch":
        return result(TrialStatus.MISMATCH, own or "its engine ran another config than the trial's")
    if data["status"] == "oom":
        return result(TrialStatus.OOM, own or "out of memory (reported by the trial)")
    if data["status"] == "failed":  # the trial's own reason; an exit status says more if there is one
        return result(TrialStatus.FAILED, exit_text(code) if code else own or "failed",
                      data_limit=None if code else data.get("data_limit"))
    wrong = _engine_mismatch(data.get("engine"), directory / "ds_config.json")
    if wrong:
        return result(TrialStatus.MISMATCH, f"its result was measured on an engine that runs another config "
                                            f"than the trial's ({wrong})")
    if code != 0:
        return result(TrialStatus.FAILED, f"{exit_text(code)} (after writing its result)")
    metrics = {name: float(data["metrics"][name]) for name in METRICS}
    return result(TrialStatus.OK, metrics=metrics, profile=data.get("profile"))
