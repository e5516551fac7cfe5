"""A script's own DeepSpeed config (toolkit/dsat/script_config.py): the record a trial left read back,
and the line comparing the best with the user's own config (pure; real files in tmp_path). The plan
built from a recorded config: tests/dsat/test_conventions.py."""

from __future__ import annotations

import json

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.script_config import own_comparison, recorded
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.dsat.trial.engine_hook import SCRIPT_CONFIG_FILE

OWN = {"train_batch_size": 16, "zero_optimization": {"stage": 2}}


def _record(out, trial_id, text):
    trial_dir = out / "trials" / f"trial_{trial_id}"
    trial_dir.mkdir(parents=True)
    (trial_dir / SCRIPT_CONFIG_FILE).write_text(text)


def test_only_a_readable_record_of_the_scripts_own_config_counts(tmp_path):
    assert recorded(tmp_path, 1) is None  # nothing recorded
    _record(tmp_path, 1, json.dumps({"source": "script", "config": OWN}))
    assert recorded(tmp_path, 1) == OWN
    _record(tmp_path, 2, '{"source": "script", "config": {"train_batch_size": 1')  # cut off mid-write
    assert recorded(tmp_path, 2) is None
    _record(tmp_path, 3, json.dumps({"source": "trial", "config": OWN}))  # dsat's own file handed back
    assert recorded(tmp_path, 3) is None


def test_an_own_config_that_measured_nothing_says_so():
    spec = TrialSpec(4, 8, {"stage": 2}, label="own")
    own = [TrialResult(spec, TrialStatus.OOM), TrialResult(TrialSpec(6, 8, {"stage": 2}, rerun=True),
                                                          TrialStatus.FAILED)]
    best = TrialResult(TrialSpec(5, 4, {"stage": 1}), TrialStatus.OK, {"throughput": 10.0})
    line, record = own_comparison(own, best, "throughput")
    assert line == (f"your own config (stage 2, micro-batch 8; trial {spec.name}, {own[1].spec.name}): "
                    "failed, oom, no throughput measured")
    assert record["statuses"] == ["oom", "failed"] and record["value"] is None and record["factor"] is None
    assert own_comparison([], best, "throughput") == ("", {})
