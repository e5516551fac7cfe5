"""The ZeRO configuration space the autotuner searches (knobs per stage), and random draws from it.

Configurations are built on the user's section, never mutated, without what the stage cannot take.
Pure; any rank. Design: docs/design-dsat-search.md#the-zero-space.
"""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Iterable, Mapping, Sequence

from toolkit._checks import is_mapping

__all__ = ["STAGE_KNOBS", "ZeroSpace", "canonical_zero", "default_zero_autos", "offloads_nothing",
           "zero_config_for_stage"]

_BUCKETS = (50_000_000, 200_000_000, 500_000_000)
_STAGE12 = (
    ("reduce_bucket_size", _BUCKETS),
    ("allgather_bucket_size", _BUCKETS),
    ("overlap_comm", (True, False)),
    ("reduce_scatter", (True, False)),
    ("contiguous_gradients", (True, False)),
)

#: Per stage, the knobs searched and their values (ints for sizes, as DeepSpeed's model wants).
#: What DeepSpeed 0.19's optimizers read per stage; ``allgather_partitions`` is read by none, so left out.
STAGE_KNOBS: Mapping[int, tuple[tuple[str, tuple[Any, ...]], ...]] = {
    0: (),
    1: _STAGE12,
    2: _STAGE12,
    3: (
        ("reduce_bucket_size", _BUCKETS),
        ("overlap_comm", (True, False)),
        ("reduce_scatter", (True, False)),
        ("contiguous_gradients", (True, False)),
        ("stage3_prefetch_bucket_size", (50_000_000, 200_000_000, 500_000_000)),
        ("stage3_param_persistence_threshold", (10_000, 100_000, 1_000_000)),
        ("stage3_max_live_parameters", (100_000_000, 1_000_000_000)),
        ("sub_group_size", (100_000_000, 1_000_000_000)),
    ),
}


#: DeepSpeed 0.19's values for knobs a ZeRO section leaves out (``deepspeed/runtime/zero/config.py``;
#: ``overlap_comm`` defaults to True at stage 3 only), and the field names its config model also
#: accepts for the ``stage3_`` aliases: to recognise a user's section equal to one of the space.
_KNOB_DEFAULTS: Mapping[str, Any] = {
    "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000, "reduce_scatter": True,
    "contiguous_gradients": True, "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000, "stage3_max_live_parameters": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
_FIELD_NAMES: Mapping[str, str] = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
                                   "stage3_param_persistence_threshold": "param_persistence_threshold",
                                   "stage3_max_live_parameters": "max_live_parameters"}


def default_zero_autos(zero: Any) -> Any:
    """A copy of a ZeRO section with its model-size ``"auto"`` values at DeepSpeed's defaults (the search
    picks bucket sizes; no ``hidden_size`` resolved them); a non-mapping as is. Pure."""
    if not is_mapping(zero):
        return zero
    return {key: (_KNOB_DEFAULTS[key] if value == "auto" and key in _AUTO_KNOBS else copy.deepcopy(value))
            for key, value in zero.items()}


def offloads_nothing(key: str, value: Any) -> bool:
    """``key: value`` is an offload section that moves nothing (its device ``none``). Pure."""
    return key in ("offload_optimizer", "offload_param") and is_mapping(value) \
        and str(value.get("device", "none")) == "none"


def canonical_zero(zero: Mapping[str, Any]) -> str:
    """The JSON key that two ZeRO sections the same to DeepSpeed share: no-op offloads and default knobs
    left out, whole floats as ints, ``stage3_`` aliases under one name. Pure."""
    stage = zero.get("stage", 0)
    out: dict[str, Any] = {}
    for key, value in zero.items():
        if offloads_nothing(key, value):
            continue
        name = next((alias for alias, field in _FIELD_NAMES.items() if field == key), key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        default = (stage == 3) if name == "overlap_comm" else _KNOB_DEFAULTS.get(name, _NO_DEFAULT)
        if name != "stage" and isinstance(value, bool) == isinstance(default, bool) and value == default:
            continue
        out[name] = value
    return json.dumps(out, sort_keys=True, default=str)


_NO_DEFAULT = object()

#: The ZeRO values HF-style configs may leave "auto" (toolkit.resolve_ds_config's hidden_size rule).
_AUTO_KNOBS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def zero_config_for_stage(base_zero: Mapping[str, Any], stage: int,
                          knobs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The user's ZeRO section at ``stage`` with ``knobs`` set, a new dict, without the offload
    sections and ``compute_grad_norm: false`` the stage does not allow. Pure."""
    if stage not in STAGE_KNOBS:
        raise ValueError(f"stage={stage!r}: expected a ZeRO stage 0, 1, 2 or 3")
    zero = copy.deepcopy(dict(base_zero))
    zero["stage"] = stage
    if stage != 3:
        zero.pop("offload_param", None)
    opt: Any = zero.get("offload_optimizer")
    if stage < 2:
        zero.pop("offload_optimizer", None)
    elif stage < 3 and is_mapping(opt) and (float(opt.get("ratio", 1.0)) < 1.0
                                            or opt.get("device") == "nvme"):
        # DeepSpeed: "Partial offloading only supported for ZeRO Stage 3"; NVMe needs stage 3.
        zero.pop("offload_optimizer", None)
    if stage not in (1, 2) and zero.get("compute_grad_norm") is False:
        zero.pop("compute_grad_norm")
    for key, value in (knobs or {}).items():
        zero[key] = copy.deepcopy(value)
    return zero


class ZeroSpace:
    """The finite set of ZeRO configurations over ``stages``, drawn without repeats with the caller's
    ``random.Random``. Pure logic."""

    def __init__(self, stages: Iterable[int], *, base_zero: Mapping[str, Any]) -> None:
        self._stages = tuple(sorted(set(stages)))
        for s in self._stages:
            if s not in STAGE_KNOBS:
                raise ValueError(f"zero stage {s!r}: expected 0, 1, 2 or 3")
        self._base = copy.deepcopy(dict(base_zero))
        self._sizes = {s: math.prod(len(v) for _, v in STAGE_KNOBS[s]) for s in self._stages}
        self._drawn: dict[int, set[int]] = {s: set() for s in self._stages}

    @property
    def stages(self) -> tuple[int, ...]:
        return self._stages

    def size(self, stages: Iterable[int] | None = None) -> int:
        """Number of configurations of ``stages`` (default: all stages of the space)."""
        return sum(self._sizes[s] for s in self._pick(stages))

    def remaining(self, stages: Iterable[int] | None = None) -> int:
        """Configurations of ``stages`` not drawn yet."""
        return sum(self._sizes[s] - len(self._drawn[s]) for s in self._pick(stages))

    def draw(self, rng: random.Random, *, stages: Iterable[int] | None = None) -> dict[str, Any] | None:
        """A configuration not drawn before (a stage uniformly, then one of its configurations), or None
        when ``stages`` are exhausted."""
        open_stages = [s for s in self._pick(stages) if len(self._drawn[s]) < self._sizes[s]]
        if not open_stages:
            return None
        stage = rng.choice(open_stages)
        drawn, size = self._drawn[stage], self._sizes[stage]
        if len(drawn) * 2 < size:
            index = rng.randrange(size)
            while index in drawn:  # expected < 2 tries while at most half is drawn
                index = rng.randrange(size)
        else:
            index = rng.choice([i for i in range(size) if i not in drawn])
        drawn.add(index)
        return zero_config_for_stage(self._base, stage, self._knobs(stage, index))

    def user_config(self, stage: int) -> dict[str, Any]:
        """The user's own section at ``stage``, counted as drawn when it is one of the stage's
        configurations. At most once per stage."""
        if stage not in self._stages:
            raise ValueError(f"stage={stage!r}: not a stage of this space {list(self._stages)}")
        zero = zero_config_for_stage(self._base, stage)
        index = self._index_of(stage, zero)
        if index is not None:
            self._drawn[stage].add(index)
        return zero

    @staticmethod
    def _index_of(stage: int, zero: Mapping[str, Any]) -> int | None:
        """The index of the stage's configuration equal to ``zero``'s knobs, or None."""
        index, radix = 0, 1
        for key, values in STAGE_KNOBS[stage]:
            default = (stage == 3) if key == "overlap_comm" else _KNOB_DEFAULTS[key]
            value = zero.get(key, zero.get(_FIELD_NAMES.get(key, key), default))
            # bool first: True == 1, and a bucket size of 1 is not "true"
            digit = next((i for i, v in enumerate(values)
                          if isinstance(v, bool) == isinstance(value, bool) and v == value), None)
            if digit is None:
                return None
            index += digit * radix
            radix *= len(values)
        return index

    def _pick(self, stages: Iterable[int] | None) -> Sequence[int]:
        if stages is None:
            return self._stages
        wanted = set(stages)
        return [s for s in self._stages if s in wanted]

    @staticmethod
    def _knobs(stage: int, index: int) -> dict[str, Any]:
        """Decode ``index`` (mixed radix over the stage's knobs) into knob values."""
        knobs: dict[str, Any] = {}
        for key, values in STAGE_KNOBS[stage]:
            index, digit = divmod(index, len(values))
            knobs[key] = values[digit]
        return knobs
