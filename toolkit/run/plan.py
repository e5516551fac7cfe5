"""What to launch, decided from the experiment config and the flags alone (pure).

``plan_run`` checks the whole config (every problem named, nothing started) and picks the
launcher: torchrun for a plain entrypoint or ``determined.launch.torch_distributed`` (its
``--nproc_per_node N --`` honoured), DeepSpeed's launcher for ``determined.launch.deepspeed``.
Runner process only.

Example::

    plan = plan_run(config, config_path=Path("exp.yaml"), model_dir=Path("."), output_dir=None)
    plan.launcher, plan.nproc      # ('torchrun', 2)
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from toolkit.config.checkpoint_storage import checkpoint_storage_problems
from toolkit.config.hyperparameters import check_space
from toolkit.config.searcher_section import check_searcher, translate_searcher
from toolkit.errors import ConfigError
from toolkit.launch.experiment_env import environment_variables_problems
from toolkit.launch.trial_files import output_dir_for
from toolkit.launch.wrappers import python_module, torchrun_nproc_override, unwrap_launcher

__all__ = ["PORTING", "plan_run", "refused_entrypoint", "RunPlan"]

logger = logging.getLogger("toolkit.run")

#: Where docs/determined.md says how to port a Trial-API or Horovod experiment to the Core API.
PORTING = "docs/determined.md#trial-api-and-horovod-experiments"
#: Determined's ``match_legacy_trial_class``: an entrypoint ``module:Class`` is a Trial-API class.
_TRIAL_CLASS = re.compile(r"^[a-zA-Z0-9_.]+:[a-zA-Z0-9_]+$")
_REFUSED_LAUNCHERS = {
    "determined.launch.horovod": "starts Horovod (horovodrun), which toolkit does not run; launch the "
                                 "script with python3 -m determined.launch.torch_distributed (PyTorch DDP) "
                                 "or determined.launch.deepspeed instead",
    "determined.launch.tensorflow": "starts TensorFlow's distributed training, which toolkit does not run "
                                    "(it trains PyTorch with DeepSpeed)",
}


def refused_entrypoint(argv: list[str]) -> str | None:
    """Why toolkit cannot run this entrypoint (a Determined Trial-API class, Horovod, TensorFlow), or None.

    Pure; runner only. Determined ran ``model_def:Trial`` through its Trial-API harness and
    ``determined.launch.horovod`` through horovodrun; here either would fail at once and be
    restarted ``max_restarts`` times, so :func:`plan_run` refuses it first.

    Example:
        >>> refused_entrypoint(["model_def:MNistTrial"]).split(" (")[0][:60]
        "entrypoint='model_def:MNistTrial' names a class of Determine"
    """
    if len(argv) == 1 and _TRIAL_CLASS.match(argv[0]):
        return (f"entrypoint={argv[0]!r} names a class of Determined's Trial API (PyTorchTrial, "
                "DeepSpeedTrial), which toolkit does not run; port the trial to a Core API script and name "
                f"that script, e.g. 'entrypoint: python3 train.py' ({PORTING})")
    module = python_module(argv)
    if module in _REFUSED_LAUNCHERS:
        return f"entrypoint={' '.join(argv)!r:.200}: {module} {_REFUSED_LAUNCHERS[module]} ({PORTING})"
    return None


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What to launch, decided from the config and flags alone (pure; any process; see :func:`plan_run`).

    Frozen: a search's trial gets its own copy through :meth:`with_output_dir`.
    """

    launcher: str
    command: list[str]
    nproc: int
    max_restarts: int
    output_dir: Path
    config_path: Path
    model_dir: Path
    config: Mapping[str, Any] = field(default_factory=dict)
    #: The entrypoint named a Determined launcher wrapper (torch_distributed, deepspeed);
    #: without one, each rank process plays one Determined container (see ``toolkit.run``).
    wrapped: bool = False

    def with_output_dir(self, output_dir: Path) -> RunPlan:
        """This plan with another output directory (a search's trial)."""
        return replace(self, output_dir=output_dir)


def _launcher_of(argv: list[str], problems: list[str]) -> tuple[str, list[str], int | None, bool]:
    """(launcher, user command, process count from the wrapper or None, wrapped); problems appended."""
    if not argv:
        return "torchrun", argv, None, False
    try:
        found, wrapper_args, command = unwrap_launcher(argv)
        nproc, ignored = torchrun_nproc_override(wrapper_args)
    except ConfigError as err:
        problems.extend(err.problems)
        return "torchrun", argv, None, False
    if ignored:
        logger.warning(
            "entrypoint: torchrun arguments %s are ignored; toolkit.run sets processes, "
            "address and port itself",
            ignored,
        )
    launcher = found or ("deepspeed" if os.path.basename(command[0]) == "deepspeed" else "torchrun")
    return launcher, command, nproc, found is not None


def _entrypoint(config: Mapping[str, Any], problems: list[str]) -> list[str]:
    """The entrypoint as an argv list (empty when missing or malformed); problems appended."""
    entry = config.get("entrypoint")
    if entry is None:
        problems.append("entrypoint is missing: expected e.g. 'entrypoint: python3 train.py'")
        return []
    try:
        argv = [str(part) for part in entry] if isinstance(entry, list) else shlex.split(str(entry))
    except ValueError as err:  # an unbalanced quote: the experiment check names it too
        problems.append(f"entrypoint={entry!r:.200}: cannot be split into arguments ({err}); balance the "
                        "quotes, or write the entrypoint as a list of arguments")
        return []
    refused = refused_entrypoint(argv)
    if refused:
        problems.append(refused)
    return argv


def plan_run(
    config: Mapping[str, Any], *, config_path: Path, model_dir: Path, output_dir: Path | None
) -> RunPlan:
    """Check the experiment and decide the launch. Runner only.

    Pure, but reads ``$TOOLKIT_OUTPUT_DIR`` (the default output directory) and logs the notice of
    a searcher section written for Determined 0.37 (:mod:`toolkit.config.searcher_section`; the
    plan's ``config`` is the translated one).

    Raises:
        ConfigError: every problem, each naming its key (entrypoint, searcher.name, a search
            space, checkpoint_storage, max_restarts, the wrapper's arguments,
            environment.environment_variables), and an entrypoint toolkit cannot run
            (:func:`refused_entrypoint`).
    """
    problems: list[str] = []
    argv = _entrypoint(config, problems)
    config, notice, translation_problems = translate_searcher(config)
    problems.extend(translation_problems)
    if notice:
        logger.warning("%s", notice)
    problems.extend(check_searcher(config))
    restarts = config.get("max_restarts", 5)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        problems.append(f"max_restarts={restarts!r}: expected an integer >= 0")
    problems.extend(check_space(config.get("hyperparameters") or {}))
    problems.extend(environment_variables_problems(config))
    problems.extend(checkpoint_storage_problems(config.get("checkpoint_storage")))
    launcher, command, nproc, wrapped = _launcher_of(argv, problems)
    if problems:  # a grid's range problems come from both space checks: each named once
        raise ConfigError(list(dict.fromkeys(problems)), source=str(config_path))
    slots = int((config.get("resources") or {}).get("slots_per_trial", 1))
    out = output_dir or output_dir_for(config)
    return RunPlan(
        launcher=launcher,
        command=command,
        nproc=nproc or slots,
        max_restarts=int(restarts),
        output_dir=out.resolve(),
        config_path=config_path.resolve(),
        model_dir=model_dir.resolve(),
        config=config,
        wrapped=wrapped,
    )
