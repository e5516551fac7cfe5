"""toolkit.dsat.tuned_keys: the trial's keys over a script's config, and an engine held to them (pure)."""

import copy
import types

import torch

from toolkit.dsat.tuned_keys import (
    INSTRUMENTATION,
    config_summary,
    data_batch_sizes,
    engine_summary,
    merge_tuned,
    mismatches,
    strip_instrumentation,
)

SCRIPT = {
    "train_batch_size": 32,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 1}},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "flops_profiler": {"enabled": True, "top_modules": 3},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
}
TRIAL = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000},
    "optimizer": {"type": "SGD"},
    **INSTRUMENTATION,
}


def test_the_tuned_keys_replace_the_scripts_and_its_own_keys_stay():
    script, trial = copy.deepcopy(SCRIPT), copy.deepcopy(TRIAL)
    merged = merge_tuned(script, trial, instrumented=True)
    assert (script, trial) == (SCRIPT, TRIAL)  # neither input changed
    # the batch triple and the whole ZeRO section are the trial's (the script's offload is gone with it)
    assert {
        k: merged[k]
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "zero_optimization",
        )
    } == {
        k: TRIAL[k]
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "zero_optimization",
        )
    }
    # optimizer, precision and clipping stay the script's; the profilers are switched off, their options kept
    assert merged["optimizer"] == SCRIPT["optimizer"] and merged["bf16"] == {"enabled": True}
    assert merged["gradient_clipping"] == 1.0
    assert merged["flops_profiler"] == {"enabled": False, "top_modules": 3}
    assert merged["autotuning"] == {"enabled": False}
    merged["zero_optimization"]["stage"] = 0
    assert TRIAL["zero_optimization"]["stage"] == 3  # a copy, not the trial's own dict


def test_a_batch_key_the_trial_leaves_out_is_dropped_and_the_best_has_no_instrumentation():
    # the script's train_batch_size 32 would contradict micro-batch 4 x accumulation 1 on any world size
    best = merge_tuned(
        SCRIPT, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, instrumented=False
    )
    assert "train_batch_size" not in best and best["zero_optimization"] == SCRIPT["zero_optimization"]
    assert best["flops_profiler"] == SCRIPT["flops_profiler"] and "autotuning" not in best
    # what dsat's instrumentation put in a recorded config goes; a user's own section of that name stays
    recorded = merge_tuned({"optimizer": {}}, TRIAL, instrumented=True)
    assert set(strip_instrumentation(recorded, {})) == set(recorded) - set(INSTRUMENTATION)
    assert strip_instrumentation(recorded, {"autotuning": {"enabled": False}})["autotuning"] == {
        "enabled": False
    }


def test_summaries_of_configs_and_engines_and_what_differs():
    assert config_summary(TRIAL) == {
        "micro_batch": 16,
        "gradient_accumulation_steps": 2,
        "stage": 3,
        "offload_optimizer": "none",
        "offload_param": "none",
    }
    assert config_summary(SCRIPT)["offload_optimizer"] == "cpu"
    assert config_summary({"zero_optimization": True}) == {
        "stage": 1,
        "offload_optimizer": "none",
        "offload_param": "none",
    }  # DeepSpeed's legacy form
    assert config_summary({"train_micro_batch_size_per_gpu": 1}) == {"micro_batch": 1}  # no section: no stage

    class Device(str):  # DeepSpeed's OffloadDeviceEnum is a str enum with .value
        value = property(lambda self: str.__str__(self))

    engine = types.SimpleNamespace(
        train_micro_batch_size_per_gpu=lambda: 2,
        gradient_accumulation_steps=lambda: 1,
        zero_optimization_stage=lambda: 1,
        zero_offload_optimizer=lambda: types.SimpleNamespace(device=Device("cpu")),
        zero_offload_param=lambda: None,
    )
    summary = engine_summary(engine)
    assert summary == {
        "micro_batch": 2,
        "gradient_accumulation_steps": 1,
        "stage": 1,
        "offload_optimizer": "cpu",
        "offload_param": "none",
    }
    assert mismatches(summary, {"micro_batch": 2, "stage": 1}) == []
    assert mismatches(summary, config_summary(TRIAL)) == [
        "micro-batch: the engine runs 2, the trial is labelled 16",
        "gradient accumulation: the engine runs 1, the trial is labelled 2",
        "ZeRO stage: the engine runs 1, the trial is labelled 3",
        "offload_optimizer: the engine runs 'cpu', the trial is labelled 'none'",
    ]


def test_where_a_forward_call_counts_its_examples():
    x, ids, seq_first = torch.zeros(8, 3), torch.zeros(8, 128, dtype=torch.long), torch.zeros(50, 4, 16)
    assert data_batch_sizes((x,), {}) == {8, 3}
    assert data_batch_sizes((), {"input_ids": ids, "labels": ids}) == {8, 128}
    assert data_batch_sizes(((x, x),), {}) == {8, 3} and data_batch_sizes(({"x": x},), {}) == {8, 3}
    assert data_batch_sizes((seq_first,), {}) == {50, 4}  # sequence-first layouts too
    assert data_batch_sizes((ids.T,), {}) == {128, 8}  # [T, B] token ids (word_language_model's layout)
    assert data_batch_sizes((1, "text", torch.tensor(3.0)), {}) == set()  # no tensor with a dimension
