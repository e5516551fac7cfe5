"""A ``python -m toolkit.run`` search's state as typed records, read and written at the JSON edge.

:class:`SearchState` holds what the searcher decided (:mod:`toolkit.run.searchers`) and each
trial's :class:`TrialRecord`; :meth:`SearchState.from_json` reads a record of any earlier toolkit
(one ASHA bracket at the top, the searcher's name alone, trials without ``seed`` or ``bracket``)
in today's form. The file itself: :mod:`toolkit.run.search_record`. Pure; runner process only.
Example::

    state = SearchState.from_json(json.loads(text), source="runs/hp/determined_search.json")
    state.trials[0].state, state.to_json()["seed"]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from toolkit._checks import is_int, is_number
from toolkit.config.searcher_section import SEARCHERS
from toolkit.errors import CheckpointError

__all__ = ["STATES", "AshaState", "Bracket", "SearchState", "TrialRecord", "trial_dir"]

#: A trial's states: created, running, stopped by a signal (a rerun resumes it), ended, failed.
STATES = ("PENDING", "RUNNING", "PAUSED", "COMPLETED", "ERROR")
#: Written only when set (a record of an earlier toolkit lacks them; ``metric`` stands for
#: ``best_metric`` there, as ``get_experiment_best_validation`` reads it).
_OPTIONAL = ("best_metric", "bracket", "progress", "early_exit", "trial_id", "exit_status")
_FIX = "delete it to start the search over, or use a new --output-dir"


def trial_dir(index: int) -> str:
    """The directory of a search's trial ``index``, under the search's output directory. Pure."""
    return f"trial-{index:04d}"


@dataclasses.dataclass
class TrialRecord:
    """One trial of a search, as ``determined_search.json`` lists it. The runner's main thread alone
    changes it: its ``state``, the reports it read (``metric`` the latest, ``best_metric``, ``time``,
    ``progress``), how it ended (``stopped_early``, ``early_exit``, ``exit_status``)."""

    index: int
    hparams: dict[str, Any]
    seed: int | None = None
    state: str = "PENDING"
    metric: float | None = None
    best_metric: float | None = None
    time: float | None = None
    stopped_early: bool = False
    bracket: int | None = None
    progress: float | None = None
    early_exit: str | None = None
    trial_id: int | None = None
    exit_status: int | None = None
    slurm_jobs: list[str] = dataclasses.field(default_factory=list)

    @property
    def dir(self) -> str:
        return trial_dir(self.index)

    @property
    def ended(self) -> bool:
        return self.state in ("COMPLETED", "ERROR")

    def summary(self) -> dict[str, Any]:
        """Its directory, values and metric (the line that ends a search)."""
        return {"dir": self.dir, "hparams": self.hparams, "metric": self.metric}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "dir": self.dir, "hparams": self.hparams,
                               "seed": self.seed, "state": self.state, "metric": self.metric,
                               "time": self.time, "stopped_early": self.stopped_early}
        out.update((key, getattr(self, key)) for key in _OPTIONAL if getattr(self, key) is not None)
        if self.slurm_jobs:
            out["slurm_jobs"] = list(self.slurm_jobs)
        return out

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> TrialRecord:
        """A trial of a search record; CheckpointError naming ``where`` when it is not one."""
        problem = _trial_problem(data)
        if problem:
            raise CheckpointError(f"{where}: {problem}; {_FIX}")
        numbers = {key: data.get(key) for key in ("metric", "best_metric", "time", "progress")}
        return cls(index=data["index"], hparams=dict(data["hparams"]), seed=data.get("seed"),
                   state=data["state"], stopped_early=bool(data.get("stopped_early")),
                   bracket=data.get("bracket"), early_exit=data.get("early_exit"),
                   trial_id=data.get("trial_id"), exit_status=data.get("exit_status"),
                   slurm_jobs=[str(j) for j in data.get("slurm_jobs") or ()],
                   **{key: (float(v) if is_number(v) else None) for key, v in numbers.items()})


def _trial_problem(data: Any) -> str | None:
    if not isinstance(data, Mapping):
        return f"expected a trial (an object), found {type(data).__name__}"
    index = data.get("index")
    if not (is_int(index) and index >= 0):
        return f"index={index!r}: expected an integer >= 0"
    if data.get("dir", trial_dir(index)) != trial_dir(index):
        return f"dir={data.get('dir')!r}: expected {trial_dir(index)!r}, the directory of trial {index}"
    if not isinstance(data.get("hparams"), Mapping) or data.get("state") not in STATES:
        return f"hparams and state={data.get('state')!r}: expected an object and one of {', '.join(STATES)}"
    for key in ("seed", "bracket", "trial_id", "exit_status"):
        if data.get(key) is not None and not is_int(data[key]):
            return f"{key}={data[key]!r}: expected an integer"
    return None


@dataclasses.dataclass
class Bracket:
    """One ASHA bracket: its rungs (``time_metric`` values), its share of ``max_trials``, and per rung
    the reports it has so far, ``(trial index, value)`` sorted by value (smaller is better)."""

    rungs: list[int]
    max_trials: int
    metrics: list[list[tuple[int, float]]]

    def to_json(self) -> dict[str, Any]:
        return {"rungs": list(self.rungs), "max_trials": self.max_trials,
                "metrics": [[[i, v] for i, v in rung] for rung in self.metrics]}


@dataclasses.dataclass
class AshaState:
    """ASHA's brackets and the rung each trial works towards (its index in its bracket's rungs)."""

    brackets: list[Bracket]
    trial_rung: dict[int, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"brackets": [b.to_json() for b in self.brackets],
                "trial_rung": {str(i): r for i, r in sorted(self.trial_rung.items())}}


@dataclasses.dataclass
class SearchState:
    """A search: its searcher, seed, what it recorded of the YAML (``searcher_config`` None: a record
    of an early toolkit, which kept the searcher's name alone), its trials and ASHA's state."""

    searcher: str
    seed: int
    trials: list[TrialRecord]
    searcher_config: dict[str, Any] | None = None
    hyperparameters: Any = None
    experiment_seed: Any = None
    asha: AshaState | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"searcher": self.searcher, "seed": self.seed}
        if self.searcher_config is not None:
            out.update(searcher_config=self.searcher_config, hyperparameters=self.hyperparameters,
                       experiment_seed=self.experiment_seed)
        out["trials"] = [t.to_json() for t in self.trials]
        if self.asha is not None:
            out["asha"] = self.asha.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> SearchState:
        """A search record of this toolkit or an earlier one, in today's form.

        Raises:
            CheckpointError: not a search record (naming ``source`` and what is wrong).
        """
        if not (isinstance(data, Mapping) and isinstance(data.get("trials"), list)
                and is_int(data.get("seed"))):
            raise CheckpointError(f"{source} is not a search state (expected an object with 'seed' and "
                                  f"'trials'); {_FIX}")
        trials = [TrialRecord.from_json(t, where=f"{source}: trials[{n}]")
                  for n, t in enumerate(data["trials"])]
        if [t.index for t in trials] != list(range(len(trials))):
            raise CheckpointError(f"{source}: the trials' indices are {[t.index for t in trials]}; expected "
                                  f"0, 1, ... in order; {_FIX}")
        if data.get("searcher", "single") not in SEARCHERS or \
                (data.get("searcher") == "adaptive_asha" and not isinstance(data.get("asha"), Mapping)):
            raise CheckpointError(f"{source}: searcher={data.get('searcher')!r} with asha="
                                  f"{type(data.get('asha')).__name__}: expected one of "
                                  f"{', '.join(SEARCHERS)}, and ASHA's state for adaptive_asha; {_FIX}")
        recorded = data.get("searcher_config")
        state = cls(searcher=str(data.get("searcher") or "single"), seed=int(data["seed"]), trials=trials,
                    searcher_config=dict(recorded) if isinstance(recorded, Mapping) else None,
                    hyperparameters=data.get("hyperparameters"), experiment_seed=data.get("experiment_seed"))
        if data.get("asha") is not None:
            state.asha = _asha_from_json(data["asha"], recorded, len(trials), source=source)
        return state


def _asha_from_json(asha: Any, recorded: Any, trials: int, *, source: str) -> AshaState:
    """ASHA's state; an earlier toolkit's single bracket at the top of ``asha`` (Determined's
    ``aggressive`` mode: one bracket of every trial) becomes today's first and only bracket."""
    try:
        if "brackets" not in asha and "rungs" in asha:
            max_trials = (recorded or {}).get("max_trials", trials)
            asha = dict(asha, brackets=[{"rungs": asha["rungs"], "metrics": asha["metrics"],
                                         "max_trials": max_trials}])
        brackets = [Bracket(rungs=[int(r) for r in b["rungs"]], max_trials=int(b["max_trials"]),
                            metrics=[[(int(i), float(v)) for i, v in rung] for rung in b["metrics"]])
                    for b in asha["brackets"]]
        rungs = {int(i): int(r) for i, r in (asha.get("trial_rung") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{source}: asha is not ASHA's state ({type(err).__name__}: {err}); "
                              f"{_FIX}") from None
    if any(len(b.metrics) != len(b.rungs) for b in brackets) or not brackets:
        raise CheckpointError(f"{source}: asha's brackets need one list of reports per rung; {_FIX}")
    return AshaState(brackets=brackets, trial_rung=rungs)
