"""The memory model against hand-computed numbers (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.dsat.contract import ProfileInfo
from toolkit.dsat.search.memory import (
    approx_max_micro_batch,
    format_prediction,
    model_memory_bytes,
    offload_flags,
    predict,
)


def _profile(n=1000, n_t=1000, *, act=100, mem=17_000, base=0, half=False):
    return ProfileInfo(num_params=n, trainable_params=n_t, activation_bytes_per_example=act,
                       memory_per_slot=mem, baseline_bytes=base, half_precision=half)


# fp32, N = N_t = 1000: P = 4000, G = 4000, O = 8000.
# half, N = N_t = 1000: P = 2000, G = 4000, O = 12000.
@pytest.mark.parametrize("half,stage,s,expected", [
    (False, 0, 1, 16_000), (False, 1, 1, 16_000), (False, 2, 1, 16_000), (False, 3, 1, 16_000),
    (False, 0, 4, 16_000),
    (False, 1, 4, 4000 + 4000 + 8000 // 4),        # 10000
    (False, 2, 4, 4000 + (4000 + 8000) // 4),      # 7000
    (False, 3, 4, 16_000 // 4),                    # 4000
    (True, 0, 4, 18_000),
    (True, 1, 4, 2000 + 4000 + 12_000 // 4),       # 9000
    (True, 2, 4, 2000 + (4000 + 12_000) // 4),     # 6000
    (True, 3, 4, 18_000 // 4),                     # 4500
    (True, 3, 1, 18_000),
])
def test_model_memory_hand_computed(half, stage, s, expected):
    assert model_memory_bytes(_profile(half=half), stage, data_parallel_size=s) == expected


def test_frozen_parameters_carry_no_gradient_or_optimizer_state():
    # N = 1000, N_t = 500, fp32: P = 4000, G = 2000, O = 4000; S = 2.
    p = _profile(1000, 500)
    got = [model_memory_bytes(p, st_, data_parallel_size=2) for st_ in range(4)]
    assert got == [10_000, 4000 + 2000 + 2000, 4000 + 3000, 5000]


def test_offloaded_parts_leave_the_device():
    p = _profile()  # fp32, P = 4000, G = 4000, O = 8000, S = 4
    assert model_memory_bytes(p, 0, data_parallel_size=4, offload_optimizer=True) == 8000
    assert model_memory_bytes(p, 1, data_parallel_size=4, offload_optimizer=True) == 8000
    assert model_memory_bytes(p, 2, data_parallel_size=4, offload_optimizer=True) == 4000 + 1000
    assert model_memory_bytes(p, 3, data_parallel_size=4, offload_optimizer=True) == 2000
    assert model_memory_bytes(p, 3, data_parallel_size=4, offload_param=True) == 3000
    assert model_memory_bytes(p, 3, data_parallel_size=4, offload_param=True, offload_optimizer=True) == 1000


def test_partitions_round_up():
    # N = 1 fp32: 16 bytes over 3 slots -> 6, never 5.
    assert model_memory_bytes(_profile(1, 1), 3, data_parallel_size=3) == 6


def test_approx_max_micro_batch_hand_computed():
    assert approx_max_micro_batch(_profile(), 0, data_parallel_size=1) == (17_000 - 16_000) // 100
    assert approx_max_micro_batch(_profile(base=500), 0, data_parallel_size=1) == 5
    assert approx_max_micro_batch(_profile(), 3, data_parallel_size=4) == (17_000 - 4000) // 100
    # The model does not fit at all: still 1 (the search finds out with a real trial).
    assert approx_max_micro_batch(_profile(mem=1000), 0, data_parallel_size=1) == 1
    # No activation measured: taken as 1 byte, the bound stays finite.
    assert approx_max_micro_batch(_profile(act=0), 0, data_parallel_size=1) == 1000


@pytest.mark.parametrize("bad", [dict(stage=4), dict(stage=-1), dict(stage=True), dict(s=0), dict(s=1.5)])
def test_invalid_arguments_are_rejected(bad):
    with pytest.raises(ValueError, match="stage=|data_parallel_size="):
        model_memory_bytes(_profile(), bad.get("stage", 1), data_parallel_size=bad.get("s", 2))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 10**12), frac=st.floats(0, 1), half=st.booleans(), s=st.integers(2, 1024),
       off_opt=st.booleans(), off_par=st.booleans(), act=st.integers(0, 10**9),
       mem=st.integers(0, 10**14))
def test_higher_stages_never_need_more(n, frac, half, s, off_opt, off_par, act, mem):
    p = _profile(n, int(n * frac), act=act, mem=mem, half=half)
    kw = dict(data_parallel_size=s, offload_optimizer=off_opt, offload_param=off_par)
    mm = [model_memory_bytes(p, stage, **kw) for stage in range(4)]
    assert mm[3] <= mm[2] <= mm[1] <= mm[0]
    mb = [approx_max_micro_batch(p, stage, **kw) for stage in range(4)]
    assert 1 <= mb[0] <= mb[1] <= mb[2] <= mb[3]
    # One slot partitions nothing: every stage holds everything it keeps on the device.
    one = {model_memory_bytes(p, stage, data_parallel_size=1) for stage in range(4)}
    assert len(one) == 1


def test_offload_flags_follow_what_the_stage_allows():
    both = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}
    assert offload_flags({"stage": 0, **both}) == (False, False)
    assert offload_flags({"stage": 1, **both}) == (False, False)
    assert offload_flags({"stage": 2, **both}) == (True, False)
    assert offload_flags({"stage": 3, **both}) == (True, True)
    assert offload_flags({"stage": 3, "offload_optimizer": {"device": "none"}}) == (False, False)
    assert offload_flags({}) == (False, False)


def test_predict_and_table():
    p = _profile(mem=12_000)  # fp32: model 16000 at stage 0, 4000 at stage 3 with S = 4
    pred = predict(p, data_parallel_size=4, zero_stages=(3, 1, 0))
    assert list(pred) == [0, 1, 3]
    assert pred[0] == {"model_memory_bytes": 16_000, "free_bytes": -4000, "approx_max_micro_batch": 1,
                       "fits": False}
    assert pred[1]["model_memory_bytes"] == 10_000 and pred[1]["approx_max_micro_batch"] == 20
    assert pred[3] == {"model_memory_bytes": 4000, "free_bytes": 8000, "approx_max_micro_batch": 80,
                       "fits": True}
    off = predict(p, data_parallel_size=4, zero_stages=(0, 1, 3), offload_optimizer=True, offload_param=True)
    assert off[0]["model_memory_bytes"] == 16_000   # stage 0 cannot offload
    assert off[1]["model_memory_bytes"] == 8000
    assert off[3]["model_memory_bytes"] == 1000
    table = format_prediction(pred, profile=p)
    lines = table.splitlines()
    assert "1,000 (1,000 trainable)" in lines[0] and "fp32" in lines[0]
    assert len(lines) == 2 + 1 + 3
    assert lines[3].split()[0] == "0" and lines[3].endswith("(does not fit)")
    assert lines[5].split()[0] == "3" and lines[5].split()[-1] == "80"
