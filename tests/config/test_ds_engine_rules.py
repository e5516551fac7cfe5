"""toolkit.config.ds_engine_rules: sections of the wrong shape and values DeepSpeed's engine refuses,
each named with the fix (pure; the verdicts against live DeepSpeed are in test_ds_verdicts.py)."""

import importlib.util

import pytest

from toolkit.config.ds_engine_rules import (
    checkpoint_problems,
    communication_problems,
    is_tested_deepspeed,
    optimizer_rules,
    scheduler_problems,
)


def optimizer_problems(section, *, stage=0, device="cpu"):
    problems: list[str] = []
    optimizer_rules({"optimizer": section}, stage=stage, cpu_optimizer=False, device=device,
                    problems=problems)
    return problems


def test_an_optimizer_section_that_is_no_mapping_is_named_with_an_example():
    assert optimizer_problems("AdamW") == [
        "optimizer='AdamW': expected a mapping such as {type: AdamW, params: {lr: 0.001}}"]
    # no type: DeepSpeed builds no optimizer (the script passes its own), whatever the params say
    assert optimizer_problems({"params": {"lr": 0.1, "no_such_argument": 1}}, stage=3) == []


@pytest.mark.parametrize("version, tested", [
    ("0.19.8", True), ("v0.19.0+cpu", True), ("0.14.4+cu121", False), ("0.20.0", False), ("main", False),
    (None, True),   # no DeepSpeed installed: nothing to warn about
])
def test_which_deepspeed_versions_count_as_tested(version, tested):
    assert is_tested_deepspeed(version) is tested


@pytest.mark.skipif(importlib.util.find_spec("mup") is not None, reason="mup is installed here")
@pytest.mark.parametrize("kind", ["MuAdam", "muadamw", "MuSGD"])
def test_a_mup_optimizer_without_mup_installed_says_to_install_it(kind):
    assert optimizer_problems({"type": kind, "params": {"lr": 0.1}}) == [
        f"optimizer.type={kind!r}: DeepSpeed builds it from the 'mup' package, which is not installed; "
        "pip install mup or choose another optimizer"]


def test_a_scheduler_section_that_is_no_mapping_is_named_with_an_example():
    assert scheduler_problems({"scheduler": ["WarmupLR"]}) == [
        "scheduler=['WarmupLR']: expected a mapping such as {type: WarmupLR, params: {}}"]
    assert scheduler_problems({"scheduler": {"params": {}}}) == []  # no type: DeepSpeed builds none


@pytest.mark.parametrize("op, stage, expected", [
    ("max", 0, ["gradient_allreduce_op='max': DeepSpeed supports 'mean' or 'sum'"]),
    ("SUM", 3, ["gradient_allreduce_op='sum' with ZeRO stage 3: DeepSpeed does not support it; use 'mean' "
                "or stage 0-2"]),
    ("Sum", 2, []),
    (1, 0, ["gradient_allreduce_op=1: DeepSpeed supports 'mean' or 'sum'"]),
])
def test_the_gradient_allreduce_op(op, stage, expected):
    zero = {"reduce_scatter": False}
    assert communication_problems({"gradient_allreduce_op": op}, stage=stage, zero=zero) == expected


def test_the_checkpoint_writer_values_are_checked_in_any_case():
    assert checkpoint_problems({"checkpoint": {"writer": {"type": "fast", "data_parallel": "Socket"}}}) == []
    assert checkpoint_problems({"checkpoint": {"writer": {"type": "torch", "data_parallel": 2}}}) == [
        "checkpoint.writer.type='torch': DeepSpeed expects one of MOCK, PYTHON, FAST (any case)",
        "checkpoint.writer.data_parallel=2: DeepSpeed expects one of REPLICA, SOCKET, MACHINE (any case)"]
