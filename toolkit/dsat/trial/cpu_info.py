"""py-cpuinfo's answer, measured once per dsat run and reused by every trial process on this machine.

DeepSpeed asks py-cpuinfo at each CPU optimizer op load, and each answer costs an interpreter that
sleeps to time the clock. Runner and trial processes only; outside a trial nothing changes.
Design: docs/design-dsat-search.md#inside-a-trial.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit._files import atomic_write_json
from toolkit.runtime.trial_env import TRIAL_ENV

__all__ = ["CPUINFO_ENV", "answer_from", "install", "install_from_env", "measure_into"]

logger = logging.getLogger(__name__)

#: Names the JSON file of py-cpuinfo's answer for this machine; set by the trial runner for the
#: trials it starts on this machine, read only inside a trial.
CPUINFO_ENV = "TOOLKIT_DSAT_CPUINFO"


def answer_from(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The answer stored in ``path`` if it was measured on this host, else None. Any process."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        logger.debug("cpuinfo answer %s not used: %s", path, err)
        return None
    if not isinstance(data, dict) or data.get("host") != socket.gethostname() \
            or not isinstance(data.get("cpu_info"), dict):
        logger.debug("cpuinfo answer %s not used: not this host's (%s)", path, socket.gethostname())
        return None
    return data["cpu_info"]


def _answering(info: Mapping[str, Any], measure: Callable[[], Any]) -> Callable[[], dict[str, Any]]:
    def get_cpu_info() -> dict[str, Any]:
        return json.loads(json.dumps(info))  # a fresh copy per call, as py-cpuinfo returns

    get_cpu_info.__wrapped__ = measure  # type: ignore[attr-defined]
    get_cpu_info.toolkit_dsat_answer = True  # type: ignore[attr-defined]
    return get_cpu_info


def install(info: Mapping[str, Any]) -> bool:
    """Make ``cpuinfo.get_cpu_info`` in this process return ``info``. False when py-cpuinfo is
    not installed. Any process; dsat's runner and trial processes only."""
    try:
        import cpuinfo
    except ImportError:
        return False
    measure = getattr(cpuinfo.get_cpu_info, "__wrapped__", cpuinfo.get_cpu_info) \
        if getattr(cpuinfo.get_cpu_info, "toolkit_dsat_answer", False) else cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = _answering(info, measure)
    return True


def install_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Inside a trial whose runner measured the CPU, answer py-cpuinfo from its file; True if so. Any
    rank; never raises, and outside a trial does nothing (not even import py-cpuinfo)."""
    path = environ.get(CPUINFO_ENV)
    if not path or not environ.get(TRIAL_ENV):
        return False
    info = answer_from(path)
    return info is not None and install(info)


def measure_into(path: Path) -> Path | None:
    """Measure py-cpuinfo's answer here, write it to ``path`` (with this host's name) and answer
    this process's later calls from it; the path, or None when py-cpuinfo is missing or fails
    (trials then measure for themselves, as before). Autotuner process only."""
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
    except Exception as err:  # noqa: BLE001 (py-cpuinfo may raise anything; DeepSpeed catches all too)
        logger.info("py-cpuinfo's answer not measured (%s: %s); each trial measures its own",
                    type(err).__name__, err)
        return None
    if not isinstance(info, dict):
        return None
    atomic_write_json(path, {"host": socket.gethostname(), "cpu_info": info})
    install(info)
    return path
