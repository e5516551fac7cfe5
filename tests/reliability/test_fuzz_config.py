"""Property-based fuzzing (hypothesis) of the config merge, the batch-size resolution and the validation.

Properties:
* no input crashes them with anything but the documented errors (ConfigError, a non-mapping where
  a mapping is required included; FileNotFoundError for a missing file);
* the merge never mutates its inputs, and the source wins key by key;
* resolution is idempotent, keeps the batch relation exactly and never mutates its input;
* a config that resolves and validates for data_parallel_size=N passes validation again.

Examples per property: 60 in the short run, 600 with TOOLKIT_RELIABILITY_FULL=1.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit.config.deepspeed import (
    BATCH_KEYS,
    build_ds_config,
    overwrite_deepspeed_config,
    resolve_ds_config,
    validate_ds_config,
)
from toolkit.config.experiment import check_experiment_config
from toolkit.errors import ConfigError

FULL = os.environ.get("TOOLKIT_RELIABILITY_FULL") == "1"  # set by scripts/reliability.py
CATEGORY = "fuzzing"
# unknown fuzzed keys warn
pytestmark = pytest.mark.filterwarnings("ignore::toolkit.config.experiment.ConfigWarning")
EXAMPLES = 600 if FULL else 60
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.floats(allow_nan=True, width=32),
                    st.text(max_size=4), st.just("auto"))
keys = st.one_of(st.sampled_from([*BATCH_KEYS, "zero_optimization", "stage", "offload_param",
                                  "offload_optimizer", "device", "fp16", "bf16", "enabled", "optimizer",
                                  "reduce_bucket_size", "pipeline",
                                  # the keys of the rules that mirror deepspeed.initialize (issue 26)
                                  "scheduler", "type", "params", "nvme_path", "ratio", "compute_grad_norm",
                                  "checkpoint", "tag_validation", "parallel_write", "pipeline_stage",
                                  "communication_data_type", "gradient_allreduce_op", "prescale_gradients",
                                  "gradient_predivide_factor", "amp", "torch_adam", "warmup_num_steps"]),
                 st.text(max_size=5))
trees = st.recursive(scalars, lambda children: st.one_of(st.lists(children, max_size=3),
                                                         st.dictionaries(keys, children, max_size=4)),
                     max_leaves=12)
configs = st.dictionaries(keys, trees, max_size=6)
batch_value = st.one_of(st.none(), st.just("auto"), st.integers(-2, 64), st.sampled_from(["8", 2.0, True]))
stage_forms = st.sampled_from(["1", 2.0, "x"])  # DeepSpeed reads "1" and 2.0 as stages
optimizer_types = st.sampled_from(["Adam", "Lamb", "SGD", "OneBitAdam", "lion", 3])
scheduler_types = st.sampled_from(["WarmupLR", "WarmupDecayLR", "StepLR", "x"])
zero = st.one_of(st.none(), st.booleans(), st.text(max_size=2),
                 st.fixed_dictionaries({"stage": st.one_of(st.integers(-1, 4), stage_forms)},
                                       optional={"offload_param": st.fixed_dictionaries(
                                           {"device": st.sampled_from(["cpu", "nvme", "none", "gpu"])}),
                                           "offload_optimizer": st.one_of(st.none(), st.fixed_dictionaries(
                                               {"device": st.sampled_from(["cpu", "nvme", "none", "gpu"])})),
                                           "reduce_bucket_size": st.one_of(st.just("auto"),
                                                                           st.integers(1, 10))}))
batch_configs = st.fixed_dictionaries({}, optional={
    "train_batch_size": batch_value, "train_micro_batch_size_per_gpu": batch_value,
    "gradient_accumulation_steps": batch_value, "zero_optimization": zero,
    "fp16": st.fixed_dictionaries({"enabled": st.booleans()}),
    "bf16": st.fixed_dictionaries({"enabled": st.booleans()}),
    "optimizer": st.fixed_dictionaries({"type": optimizer_types},
                                       optional={"params": st.one_of(st.none(), trees)}),
    "scheduler": st.fixed_dictionaries({"type": scheduler_types},
                                       optional={"params": st.one_of(st.none(), trees)})})
dp_sizes = st.one_of(st.integers(1, 8), st.sampled_from([0, -1, True, 2.0]))


@fuzz
@given(configs, st.one_of(st.none(), configs))
def test_merge_never_mutates_and_the_source_wins(base, source):
    before_base, before_source = copy.deepcopy(base), copy.deepcopy(source)
    merged = overwrite_deepspeed_config(base, source)
    assert base == before_base and source == before_source or _has_nan(before_base, before_source)
    for key, value in (source or {}).items():
        if not isinstance(value, dict):
            assert _same(merged[key], value)
    for key in base:
        assert key in merged
    # The result shares no mutable part with either input.
    merged_again = copy.deepcopy(merged)
    _scribble(merged)
    assert _same(base, before_base) and _same(source, before_source)
    assert not _same(merged, merged_again) or not merged_again


@fuzz
@given(batch_configs, dp_sizes, st.one_of(st.none(), st.integers(-1, 64)))
def test_resolution_raises_only_config_errors_and_is_idempotent(config, dp, hidden):
    before = copy.deepcopy(config)
    try:
        resolved = resolve_ds_config(config, data_parallel_size=dp, hidden_size=hidden)
    except ConfigError as err:
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
        return
    finally:
        assert config == before  # never mutated, even when it fails
    tbs, mbs, gas = (resolved[k] for k in BATCH_KEYS)
    assert all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (tbs, mbs, gas))
    assert tbs == mbs * gas * dp
    again = resolve_ds_config(resolved, data_parallel_size=dp, hidden_size=hidden)
    assert again == resolved  # idempotent
    for key in BATCH_KEYS:  # a number the user gave is kept, never changed silently
        if isinstance(config.get(key), int) and not isinstance(config.get(key), bool) and config[key] >= 1:
            assert resolved[key] == config[key]


@fuzz
@given(batch_configs, dp_sizes, st.booleans(), st.sampled_from([None, "cpu", "cuda:0"]))
def test_validation_raises_only_config_errors(config, dp, pipeline, device):
    before = copy.deepcopy(config)
    try:
        validate_ds_config(config, pipeline=pipeline, device=device,
                           data_parallel_size=dp if isinstance(dp, int) and dp >= 1 else None)
    except ConfigError as err:
        assert err.problems
    assert config == before


@fuzz
@given(batch_configs, st.integers(1, 8), st.booleans())
def test_build_is_resolve_then_validate(config, dp, pipeline):
    hparams = {"deepspeed_config": config}
    try:
        built = build_ds_config(hparams, data_parallel_size=dp, pipeline=pipeline, device="cpu")
    except ConfigError:
        return
    validate_ds_config(built, pipeline=pipeline, device="cpu", data_parallel_size=dp)  # passes again
    assert build_ds_config({"deepspeed_config": built}, data_parallel_size=dp, pipeline=pipeline,
                           device="cpu") == built


@fuzz
@given(configs)
def test_arbitrary_trees_as_configs_raise_only_documented_errors(tree):
    for call in (lambda: resolve_ds_config(tree, data_parallel_size=2),
                 lambda: validate_ds_config(tree, data_parallel_size=2),
                 lambda: build_ds_config(tree, data_parallel_size=2),
                 lambda: build_ds_config({"deepspeed_config": tree, "overwrite_deepspeed_args": tree},
                                         data_parallel_size=2)):
        try:
            call()
        except ConfigError as err:
            assert err.problems
        except FileNotFoundError:
            pass  # a fuzzed "deepspeed_config" string is a path that does not exist


@fuzz
@given(st.dictionaries(st.sampled_from(["name", "entrypoint", "resources", "hyperparameters", "searcher",
                                        "checkpoint_storage", "x"]), trees, max_size=5))
def test_experiment_checks_raise_only_config_errors(experiment):
    try:
        check_experiment_config(json.loads(json.dumps(experiment, default=str)) if _has_nan(experiment)
                                else experiment, source="fuzz.yaml")
    except ConfigError as err:
        assert err.problems


# ---------------------------------------------------------------------------------------- helpers
def _has_nan(*objs) -> bool:
    return "nan" in repr(objs)


def _same(a, b) -> bool:
    """Equality that treats NaN as equal to itself (a fuzzed float may be NaN)."""
    return repr(a) == repr(b)


def _scribble(node) -> None:
    if isinstance(node, dict):
        for key in list(node):
            _scribble(node[key])
        node["__scribbled__"] = 1
    elif isinstance(node, list):
        for item in node:
            _scribble(item)
        node.append("__scribbled__")
