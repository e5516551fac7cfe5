"""``det.get_cluster_info()``: what a Determined trial learns about itself, built from the experiment YAML.

Determined's master wrote it into the container; here it comes from the YAML named by
``TOOLKIT_EXPERIMENT_CONFIG``, ``TOOLKIT_OUTPUT_DIR`` and the launcher's variables, read once per
process. Any rank (no collective). Where each field comes from: docs/design-determined.md#get_cluster_info.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from pathlib import Path
from typing import Any, Mapping

import toolkit
from toolkit.compat.determined import storage
from toolkit.config import hyperparameters
from toolkit.config.experiment import ConfigWarning
from toolkit.errors import ConfigError
from toolkit.launch.experiment_env import CONFIG_WARNED_ENV
from toolkit.launch.trial_files import load_trial_state, output_dir_for
from toolkit.launch.wrappers import CONTAINER_PER_RANK_ENV
from toolkit.runtime.trial_env import EXPERIMENT_CONFIG_ENV, TRIAL_HPARAMS_ENV

__all__ = ["ClusterInfo", "TrialInfo", "RendezvousInfo", "ResourcesInfo", "get_cluster_info",
           "resolve_hparams"]

logger = logging.getLogger(__name__)

_cached: "ClusterInfo | None" = None


class TrialInfo:
    """``info.trial``: the trial's ids, seed, hyperparameters and config (Determined's TrialInfo)."""

    def __init__(
        self,
        trial_id: int,
        experiment_id: int,
        trial_seed: int,
        hparams: dict[str, Any],
        config: dict[str, Any],
        steps_completed: int,
        trial_run_id: int,
        debug: bool,
        inter_node_network_interface: str | None,
    ) -> None:
        self.trial_id, self.experiment_id, self.trial_seed = trial_id, experiment_id, trial_seed
        self.hparams, self._config, self._steps_completed = hparams, config, steps_completed
        self._trial_run_id, self._debug = trial_run_id, debug
        self._inter_node_network_interface = inter_node_network_interface

    @property
    def config(self) -> dict[str, Any]:
        """The experiment config (Determined has only ``_config``; this alias is harmless)."""
        return self._config


class RendezvousInfo:
    """Addresses and slot counts of the trial's machines (``container_*``)."""

    def __init__(
        self, container_addrs: list[str], container_rank: int, container_slot_counts: list[int]
    ) -> None:
        self.container_addrs, self.container_rank = container_addrs, container_rank
        self.container_slot_counts = container_slot_counts


class ResourcesInfo:
    """GPU UUIDs of this machine (empty: toolkit does not query them)."""

    def __init__(self, gpu_uuids: list[str]) -> None:
        self.gpu_uuids = gpu_uuids


class ClusterInfo:
    """What ``det.get_cluster_info()`` returns; same attributes as Determined 0.38's ClusterInfo."""

    def __init__(
        self,
        master_url: str, cluster_id: str, agent_id: str, slot_ids: list[int], task_id: str,
        allocation_id: str, session_token: str, task_type: str,
        master_cert_name: str | None = None, master_cert_file: str | None = None,
        latest_checkpoint: str | None = None, trial_info: TrialInfo | None = None,
        rendezvous_info: RendezvousInfo | None = None, resources_info: ResourcesInfo | None = None,
    ) -> None:
        self.master_url, self.cluster_id, self.agent_id = master_url, cluster_id, agent_id
        self.slot_ids, self.task_id, self.allocation_id = slot_ids, task_id, allocation_id
        self.session_token, self.task_type = session_token, task_type
        self.master_cert_name, self.master_cert_file = master_cert_name, master_cert_file
        self._latest_checkpoint, self._trial_info = latest_checkpoint, trial_info
        self._rendezvous_info = rendezvous_info or RendezvousInfo(["127.0.0.1"], 0, [len(slot_ids)])
        self._resources_info = resources_info or ResourcesInfo([])
        # Toolkit's own: where the run writes, and the checkpoint root (used by core.init).
        self.output_dir: Path = Path(".")
        self.checkpoint_root: storage.Root = Path(".")

    @property
    def latest_checkpoint(self) -> str | None:
        return self._latest_checkpoint if self.task_type == "TRIAL" else None

    @property
    def trial(self) -> TrialInfo:
        if self.task_type != "TRIAL" or self._trial_info is None:
            raise RuntimeError(
                f'you cannot use the .trial property when .task_type ("{self.task_type}") != "TRIAL"'
            )
        return self._trial_info

    @property
    def user_data(self) -> dict[str, Any]:
        return dict(self._trial_info._config.get("data") or {}) if self._trial_info else {}

    @property
    def container_addrs(self) -> list[str]:
        return self._rendezvous_info.container_addrs

    @property
    def container_rank(self) -> int:
        return self._rendezvous_info.container_rank

    @property
    def container_slot_counts(self) -> list[int]:
        return self._rendezvous_info.container_slot_counts

    @property
    def gpu_uuids(self) -> list[str]:
        return self._resources_info.gpu_uuids


def resolve_hparams(hparams: Mapping[str, Any], prefix: str = "hyperparameters") -> dict[str, Any]:
    """Determined's hyperparameter section as one trial sees it: ``{type: const, val: X}`` becomes ``X`` at
    any depth. Pure. Raises ConfigError naming every search space (toolkit.run samples those).

    Example:
        >>> resolve_hparams({"lr": {"type": "const", "val": 0.1}, "opt": {"beta": 0.9}})
        {'lr': 0.1, 'opt': {'beta': 0.9}}
    """
    out: dict[str, Any] = {}
    problems: list[str] = []
    for name, value in hparams.items():
        key = f"{prefix}.{name}"
        if isinstance(value, Mapping) and value.get("type") == "const" and "val" in value:
            out[name] = value["val"]
        elif isinstance(value, Mapping) and value.get("type") in hyperparameters.SEARCH_TYPES:
            problems.append(
                f"{key} is a search space (type: {value['type']}) and no value was sampled for "
                "this output directory: run the experiment with python -m toolkit.run CONFIG "
                "MODEL_DIR (which samples it, as Determined's master), or give one value, e.g. "
                "{type: const, val: ...}"
            )
        elif isinstance(value, Mapping):
            try:
                out[name] = resolve_hparams(value, key)
            except ConfigError as err:
                problems.extend(err.problems)
        else:
            out[name] = value
    if problems:
        raise ConfigError(problems)
    return out


def _experiment_config() -> tuple[dict[str, Any], Path]:
    path = os.environ.get(EXPERIMENT_CONFIG_ENV)
    if not path:
        logger.warning(
            "%s is not set: no experiment config, empty hyperparameters; run through "
            "python -m toolkit.run CONFIG MODEL_DIR, or set it to the experiment YAML",
            EXPERIMENT_CONFIG_ENV,
        )
        return {}, Path.cwd()
    with warnings.catch_warnings():
        if os.environ.get(CONFIG_WARNED_ENV):  # the runner warned once for the run: not once per rank
            warnings.simplefilter("ignore", ConfigWarning)
        return hyperparameters.load_config(path), Path(path).resolve().parent


def _check_searcher(config: Mapping[str, Any]) -> None:
    name = (config.get("searcher") or {}).get("name")
    if name not in (None, "single"):
        raise ConfigError(
            f"searcher.name={name!r}: a search's trials are started by python -m toolkit.run "
            "CONFIG MODEL_DIR (random, grid, adaptive_asha), which records each trial's values; "
            "started otherwise, use 'single' (and python -m toolkit.dsat to tune DeepSpeed settings)"
        )


def _launch_layout(config: Mapping[str, Any]) -> tuple[list[int], int, int]:
    """(slot ids of this container, containers, this container's rank)."""
    env = os.environ
    if env.get(CONTAINER_PER_RANK_ENV) and "RANK" in env and "WORLD_SIZE" in env:
        return [int(env.get("LOCAL_RANK", 0))], int(env["WORLD_SIZE"]), int(env["RANK"])
    local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    slots = int(local) if local else int((config.get("resources") or {}).get("slots_per_trial", 1))
    nodes = int(env.get("GROUP_WORLD_SIZE") or env.get("CROSS_SIZE") or 1)
    node = int(env.get("GROUP_RANK") or env.get("CROSS_RANK") or 0)
    return list(range(slots)), nodes, node


def _build() -> ClusterInfo:
    config, config_dir = _experiment_config()
    output_dir = output_dir_for(config)
    state = load_trial_state(output_dir, write=os.environ.get("RANK", "0") == "0")
    if os.environ.get(TRIAL_HPARAMS_ENV):  # inside a dsat trial
        hparams = toolkit.get_hparams()
    elif "hparams" in state:  # sampled by python -m toolkit.run
        hparams = dict(state["hparams"])
    else:
        _check_searcher(config)
        hparams = resolve_hparams(config.get("hyperparameters") or {})
    root = storage.storage_root(config.get("checkpoint_storage"), output_dir=output_dir, base_dir=config_dir)
    registry = storage.read_registry(output_dir)
    written_to = storage.root_from_registry(registry["root"], root)  # core.init(checkpoint_storage=...)
    latest = storage.latest_storage_id(registry, written_to)
    steps = storage.read_metadata(written_to, latest).get("steps_completed", 0) if latest else 0
    slot_ids, nodes, node = _launch_layout(config)
    trial = TrialInfo(
        state["trial_id"],
        state["experiment_id"],
        state["trial_seed"],
        hparams,
        dict(config),
        int(steps) if isinstance(steps, int) else 0,
        state.get("trial_run_id", 1),
        bool(config.get("debug", False)),
        None,
    )
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    info = ClusterInfo(
        "",
        "toolkit",
        socket.gethostname(),
        slot_ids,
        f"trial-{state['trial_id']}",
        f"trial-{state['trial_id']}.{state.get('trial_run_id', 1)}",
        "",
        "TRIAL",
        latest_checkpoint=latest,
        trial_info=trial,
        rendezvous_info=RendezvousInfo([addr] * nodes, node, [len(slot_ids)] * nodes),
    )
    info.output_dir, info.checkpoint_root = output_dir, root
    return info


def get_cluster_info() -> ClusterInfo:
    """This trial's :class:`ClusterInfo`; never None (Determined off-cluster: None). Any rank; cached.
    Raises ConfigError naming every problem: a malformed YAML, a search space or searcher toolkit.run
    did not sample, a bad ``checkpoint_storage``. Example::

        # python -m toolkit.run deepspeed.yaml .      (or torchrun with TOOLKIT_EXPERIMENT_CONFIG set)
        info = det.get_cluster_info()
        hparams, latest = info.trial.hparams, info.latest_checkpoint
    """
    global _cached
    if _cached is None:
        _cached = _build()
    return _cached
