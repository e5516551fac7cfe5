"""The ZeRO configuration space the autotuner searches, and random draws from it.

Each stage has its own knobs (what DeepSpeed 0.19's optimizers actually read for that stage,
see ``deepspeed/runtime/engine.py``, ``_configure_zero_optimizer``):

* stage 0: no ZeRO knobs (one configuration);
* stages 1 and 2 (``DeepSpeedZeroOptimizer``): ``reduce_bucket_size``,
  ``allgather_bucket_size``, ``overlap_comm``, ``reduce_scatter``, ``contiguous_gradients``;
* stage 3 (``DeepSpeedZeroOptimizer_Stage3``): ``reduce_bucket_size``, ``overlap_comm``,
  ``reduce_scatter``, ``contiguous_gradients``, ``stage3_prefetch_bucket_size``,
  ``stage3_param_persistence_threshold``, ``stage3_max_live_parameters``, ``sub_group_size``.

``allgather_partitions`` is accepted by DeepSpeed's config model but read by no optimizer in
0.19 (``engine.zero_allgather_partitions()`` has no caller), so searching it would only spend
trials on identical runs; the user's value passes through unchanged. Add it to
:data:`STAGE_KNOBS` if a DeepSpeed version starts honouring it.

Every configuration is built on the user's ``zero_optimization`` section (deep-copied, never
mutated), with what the stage cannot take removed so that no trial is invalid:
``offload_param`` needs stage 3; ``offload_optimizer`` is kept at stages 2 and 3 only (DeepSpeed
0.19 also runs it at stage 1, and :func:`toolkit.validate_ds_config` accepts that, but earlier
releases did not), stage 3 when it goes to NVMe or its ``ratio`` < 1;
``compute_grad_norm: false`` is only valid at stages 1 and 2.

Pure; any rank (the tuner uses it on rank 0). Example::

    zero = ZeroSpace((1, 2, 3), base_zero={}).draw(random.Random(0))   # {"stage": 2, ...} or None
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
    """A copy of a ZeRO section with its model-size ``"auto"`` values (HF style, those
    :func:`toolkit.resolve_ds_config` fills from ``hidden_size``) set to DeepSpeed's defaults.

    The search chooses bucket sizes itself; a trial whose section still says ``"auto"`` after
    ``resolve_ds_config(..., hidden_size=...)`` (no ``hidden_size`` hyperparameter) runs with
    DeepSpeed's values. Anything but a mapping is returned as is. Pure; call anywhere.

    Example:
        >>> default_zero_autos({"stage": 2, "reduce_bucket_size": "auto"})
        {'stage': 2, 'reduce_bucket_size': 500000000}
    """
    if not is_mapping(zero):
        return zero
    return {key: (_KNOB_DEFAULTS[key] if value == "auto" and key in _AUTO_KNOBS else copy.deepcopy(value))
            for key, value in zero.items()}


def offloads_nothing(key: str, value: Any) -> bool:
    """Whether ``key: value`` of a ZeRO section is an offload section that moves nothing (its device
    ``"none"``, DeepSpeed's default). Pure.

    >>> offloads_nothing("offload_param", {"device": "none", "pin_memory": True})
    True
    """
    return key in ("offload_optimizer", "offload_param") and is_mapping(value) \
        and str(value.get("device", "none")) == "none"


def canonical_zero(zero: Mapping[str, Any]) -> str:
    """What makes two ZeRO sections the same configuration to DeepSpeed, as a JSON key: offload
    sections that move nothing, and knobs at DeepSpeed's values for the stage, left out; whole
    floats as integers (``3e7`` is ``30000000``); ``stage3_`` aliases under one name. Pure.

    >>> canonical_zero({"stage": 2, "offload_param": {"device": "none"}, "reduce_bucket_size": 5e8})
    '{"stage": 2}'
    """
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
    """The user's ZeRO section at ``stage`` with ``knobs`` set; a new dict, ``base_zero`` untouched.

    Pure; call anywhere. Offload sections and ``compute_grad_norm: false`` are dropped where
    ``stage`` does not allow them (see the module docstring), so DeepSpeed accepts the result.

    Example:
        >>> zero_config_for_stage({"stage": 3, "offload_param": {"device": "cpu"}}, 2,
        ...                       {"overlap_comm": True})
        {'stage': 2, 'overlap_comm': True}
    """
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
    """The finite set of ZeRO configurations over ``stages``, drawn at random without repeats.

    Every draw takes its randomness from the ``random.Random`` passed in, so a searcher owning
    that generator is deterministic. Pure logic; no process or file is touched.

    Example:
        >>> space = ZeroSpace((0, 1), base_zero={})
        >>> rng = random.Random(0)
        >>> zero = space.draw(rng)
        >>> zero["stage"] in (0, 1), space.remaining() == space.size() - 1
        (True, True)
    """

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
        """A configuration not drawn before, or None when ``stages`` are exhausted.

        The stage is chosen uniformly among the allowed stages that have configurations left
        (so stage 0, a single configuration, is not drowned by the hundreds of stage 3), then a
        configuration uniformly within that stage.
        """
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
        """The user's own ZeRO section at ``stage``, knobs as the user set them (or left them out).

        Not random. When its knob values (DeepSpeed's defaults for those left out) are one of
        the stage's configurations, that configuration counts as drawn, so no later
        :meth:`draw` repeats it; otherwise it is a configuration outside the space, and drawing
        is unaffected. Call it at most once per stage.

        Example:
            >>> space = ZeroSpace((0, 1), base_zero={"stage": 1})
            >>> space.user_config(0), space.remaining([0])
            ({'stage': 0}, 0)
        """
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
