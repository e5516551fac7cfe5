"""The ZeRO configuration space: every configuration it draws is accepted by DeepSpeed's own
config model (the real ``DeepSpeedZeroConfig`` of the installed DeepSpeed), draws never repeat,
and the user's section is built on, never mutated."""

from __future__ import annotations

import copy
import math
import random

import pytest

import toolkit
from toolkit.dsat.search.memory import offload_flags
from toolkit.dsat.search.space import STAGE_KNOBS, ZeroSpace, zero_config_for_stage

USER_ZERO = {
    "stage": 1,
    "offload_optimizer": {"device": "cpu", "pin_memory": False},
    "offload_param": {"device": "cpu"},
    "compute_grad_norm": False,
    "reduce_bucket_size": 12345678,
    "stage3_gather_16bit_weights_on_model_save": True,
}


@pytest.fixture(scope="module")
def ds_zero_config():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # the installed DeepSpeed's truth
    return DeepSpeedZeroConfig


def test_space_sizes_are_the_products_of_the_knob_grids():
    space = ZeroSpace((0, 1, 2, 3), base_zero={})
    sizes = {s: math.prod(len(v) for _, v in STAGE_KNOBS[s]) for s in range(4)}
    assert sizes[0] == 1 and space.size((0,)) == 1
    assert space.size() == sum(sizes.values())
    assert space.size((1, 3)) == sizes[1] + sizes[3]


def test_draws_never_repeat_and_exhaust_the_space():
    space = ZeroSpace((0, 1), base_zero={})
    rng = random.Random(3)
    drawn = []
    while (zero := space.draw(rng)) is not None:
        drawn.append(repr(sorted(zero.items())))
    assert len(drawn) == len(set(drawn)) == space.size()
    assert space.remaining() == 0 and space.draw(rng) is None


def test_draw_restricted_to_stages():
    space = ZeroSpace((1, 2, 3), base_zero={})
    rng = random.Random(0)
    assert {space.draw(rng, stages=(1, 2))["stage"] for _ in range(50)} == {1, 2}
    assert space.draw(rng, stages=(0,)) is None  # stage 0 is not part of this space


def test_every_drawn_config_is_valid_for_deepspeed(ds_zero_config):
    space = ZeroSpace((0, 1, 2, 3), base_zero=USER_ZERO)
    rng = random.Random(0)
    seen_stages = set()
    for _ in range(300):
        zero = space.draw(rng)
        if zero is None:
            break
        seen_stages.add(zero["stage"])
        cfg = ds_zero_config(**copy.deepcopy(zero))  # raises on an unknown key or invalid value
        assert int(cfg.stage) == zero["stage"]
        for key, values in STAGE_KNOBS[zero["stage"]]:
            assert zero[key] in values
    assert seen_stages == {0, 1, 2, 3}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_and_stage_bound_keys_kept_only_where_the_stage_allows(stage, ds_zero_config):
    before = copy.deepcopy(USER_ZERO)
    zero = zero_config_for_stage(USER_ZERO, stage, {"overlap_comm": True})
    assert USER_ZERO == before  # deep copy: the user's section is untouched
    zero["reduce_bucket_size"] = 1
    assert USER_ZERO == before
    zero = zero_config_for_stage(USER_ZERO, stage, {"overlap_comm": True})
    assert zero["stage"] == stage and zero["overlap_comm"] is True
    assert ("offload_optimizer" in zero) == (stage >= 2)
    assert ("offload_param" in zero) == (stage == 3)
    assert ("compute_grad_norm" in zero) == (stage in (1, 2))
    assert zero["reduce_bucket_size"] == 12345678  # the user's keys that are not searched stay
    assert offload_flags(zero) == (stage >= 2, stage == 3)
    ds_zero_config(**zero)
    toolkit.validate_ds_config({"zero_optimization": zero})  # toolkit's own rules accept it too


def test_partial_optimizer_offload_only_at_stage_3(ds_zero_config):
    base = {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    assert "offload_optimizer" not in zero_config_for_stage(base, 2)
    assert zero_config_for_stage(base, 3)["offload_optimizer"] == {"device": "cpu", "ratio": 0.5}
    ds_zero_config(**zero_config_for_stage(base, 2))
    ds_zero_config(**zero_config_for_stage(base, 3))


def test_invalid_stage_is_rejected():
    with pytest.raises(ValueError, match="stage=4"):
        zero_config_for_stage({}, 4)
    with pytest.raises(ValueError, match="zero stage 5"):
        ZeroSpace((1, 5), base_zero={})


def _effective_knobs(zero, stage, ds_zero_config):
    """The knob values DeepSpeed itself reads from ``zero`` at ``stage`` (its defaults filled in)."""
    parsed = ds_zero_config(**zero)
    fields = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
              "stage3_param_persistence_threshold": "param_persistence_threshold",
              "stage3_max_live_parameters": "max_live_parameters"}
    return {key: getattr(parsed, fields.get(key, key)) for key, _ in STAGE_KNOBS[stage]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_users_section_left_at_deepspeeds_defaults_counts_as_drawn(stage, ds_zero_config):
    space = ZeroSpace((stage,), base_zero={"stage": 1})
    before = space.remaining()
    assert space.user_config(stage) == {"stage": stage}
    assert space.remaining() == before - 1
    defaults = _effective_knobs({"stage": stage}, stage, ds_zero_config)
    rng = random.Random(0)
    while (zero := space.draw(rng)) is not None:  # no draw repeats the user's configuration
        assert _effective_knobs(zero, stage, ds_zero_config) != defaults


def test_the_users_section_outside_the_space_is_extra_and_kept_as_written():
    base = {"stage": 2, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5e6, "overlap_comm": True}
    space = ZeroSpace((1, 2), base_zero=base)
    before = space.remaining()
    assert space.user_config(1) == {**base, "stage": 1}
    assert space.remaining() == before                # 5e6 is not a searched bucket size
    assert base == {"stage": 2, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5e6,
                    "overlap_comm": True}


def test_the_users_section_is_matched_by_value_and_by_deepspeeds_field_names():
    # 5e8 written as a float, a stage-3 knob under its field name: still the same configuration.
    base = {"stage": 3, "reduce_bucket_size": 5e8, "prefetch_bucket_size": 200_000_000, "overlap_comm": False}
    space = ZeroSpace((3,), base_zero=base)
    before = space.remaining()
    space.user_config(3)
    assert space.remaining() == before - 1
    # A bucket size of 1 is not the boolean True (and overlap_comm=1 is not a value of the grid).
    odd = ZeroSpace((1,), base_zero={"stage": 1, "overlap_comm": 1})
    odd.user_config(1)
    assert odd.remaining() == odd.size()


def test_user_config_of_a_stage_outside_the_space_is_rejected():
    with pytest.raises(ValueError, match=r"stage=2: not a stage of this space \[1\]"):
        ZeroSpace((1,), base_zero={}).user_config(2)
