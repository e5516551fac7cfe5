"""dsat's TensorBoard curves (toolkit.dsat.tensorboard): which trials are points, the predicted and budget
lines, and what TensorBoard's own reader finds in the runs written (no processes; the real dsat run
that fills them: tests/dsat/test_e2e.py)."""

import importlib.util
import json
import xml.etree.ElementTree as ET

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import procutil
from toolkit.dsat.contract import METRICS, ProfileInfo, TrialStatus
from toolkit.dsat.search.memory import approx_max_micro_batch
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.dsat.tensorboard import TensorBoardTrials, curve_key, curve_names, curve_series

MIB = 2**20
PROFILE = ProfileInfo(num_params=10**6, trainable_params=10**6, activation_bytes_per_example=MIB,
                      memory_per_slot=600 * MIB, baseline_bytes=300 * MIB)


def ok(trial_id, mb, stage=1, throughput=100.0, peak=400, **kw):
    return TrialResult(TrialSpec(trial_id, mb, {"stage": stage}, **kw), TrialStatus.OK,
                       dict.fromkeys(METRICS, 1.0) | {"throughput": throughput}, peak_bytes=peak * MIB)


RESULTS = [
    ok(0, 1, profile=True, label="p1", throughput=5.0, peak=310),    # memory only: its global batch differs
    ok(1, 8, throughput=80.0, peak=330), ok(2, 2, throughput=30.0, peak=312),
    ok(3, 8, throughput=82.0, peak=331, rerun=True),                  # a re-run: a second point at 8
    ok(4, 4, stage=3, throughput=20.0, peak=305),
    TrialResult(TrialSpec(5, 64, {"stage": 1}), TrialStatus.OOM, peak_bytes=601 * MIB),
    TrialResult(TrialSpec(8, 128, {"stage": 1}), TrialStatus.OOM),  # a CUDA OOM before any note: the budget
    TrialResult(TrialSpec(6, 16, {"stage": 1}), TrialStatus.FAILED, error="exit 1", peak_bytes=350 * MIB),
    TrialResult(TrialSpec(7, 32, {"stage": 3}), TrialStatus.TIMEOUT, peak_bytes=500 * MIB),
]


def test_points_are_trials_that_measured_their_config_in_micro_batch_order_with_lines_to_compare():
    runs = curve_series(RESULTS, profile=PROFILE, data_parallel_size=2, memory_only=lambda s: s.profile)
    stage1, stage3 = runs["curves/stage_1"], runs["curves/stage_3"]
    assert sorted(stage1["metrics/throughput"]) == [(2, 30.0), (8, 80.0), (8, 82.0)]  # not p1, nor 5, 6
    assert sorted(stage1["memory/peak_MiB"]) == [(1, 310.0), (2, 312.0), (8, 330.0), (8, 331.0)]
    assert stage1["memory/peak_MiB_oom"] == [(64, 601.0), (128, 600.0)]
    assert stage3 == {**{f"metrics/{m}": [(4, 1.0)] for m in METRICS}, "metrics/throughput": [(4, 20.0)],
                      "memory/peak_MiB": [(4, 305.0)]}                # the timed-out trial is no point
    predicted = dict(runs["curves/stage_1_predicted"]["memory/peak_MiB"])
    top = approx_max_micro_batch(PROFILE, 1, data_parallel_size=2)
    assert {1, 2, 8, 64, 128, top} <= set(predicted) and max(predicted) == top  # to the model's boundary
    assert predicted[1] < predicted[64] < predicted[top] <= 600 < predicted[top] + 1
    budget = runs["curves/budget"]["memory/peak_MiB"]
    assert {v for _, v in budget} == {600.0} and {m for m, _ in budget} >= set(predicted)
    # without profile.json: the measured curves alone
    alone = curve_series(RESULTS, profile=None, data_parallel_size=2)
    assert set(alone) == {"curves/stage_1", "curves/stage_3"}
    assert alone["curves/stage_1"]["memory/peak_MiB_oom"] == [(64, 601.0)]
    offload = TrialSpec(9, 2, {"stage": 3, "offload_param": {"device": "cpu"},
                               "offload_optimizer": {"device": "none"}})
    assert curve_key(offload) == "stage_3_offload_param"
    # one curve per ZeRO configuration: the stage's own (the profiling trials' line), and any other line
    specs = [TrialSpec(0, 1, {"stage": 1}, line=-1), TrialSpec(4, 8, {"stage": 1, "reduce_bucket_size": 2},
                                                                line=3),
             TrialSpec(5, 8, {"stage": 1}, line=0), TrialSpec(6, 8, {"stage": 2, "x": 1}, line=4)]
    assert curve_names(specs) == {0: "stage_1", 4: "stage_1_line_3", 5: "stage_1", 6: "stage_2"}


def test_tensorboards_reader_finds_per_stage_curves_and_each_trials_run(tmp_path):
    out = tmp_path / "dsat"
    out.mkdir()
    (out / "profile.json").write_text(json.dumps({"profile": PROFILE.to_json()}))
    board = TensorBoardTrials(out / "tensorboard", data_parallel_size=2, memory_only=lambda s: s.profile)
    done = []
    for result in RESULTS:   # rewritten after every trial, as the orchestrator does
        done.append(result)
        board.add(result, done)
    curves = out / "tensorboard" / "curves"
    assert sorted(p.name for p in curves.iterdir()) == ["budget", "stage_1", "stage_1_predicted", "stage_3",
                                                        "stage_3_predicted"]
    # a file per rewrite (the last one's purge hides the others' points from TensorBoard)
    assert all(len(list(p.iterdir())) >= 1 for p in curves.iterdir())
    acc = EventAccumulator(str(curves / "stage_1"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("metrics/throughput")] == [(2, 30.0), (8, 80.0), (8, 82.0)]
    assert [e.step for e in acc.Scalars("memory/peak_MiB")] == [1, 2, 8, 8]
    trial = EventAccumulator(str(out / "tensorboard" / "trial_0001"))
    trial.Reload()
    assert [(e.step, e.value) for e in trial.Scalars("dsat/peak_MiB")] == [(8, pytest.approx(330.0))]
    # the picture of docs/dsat.md is drawn from these runs, read back the same way
    path = procutil.REPO / "scripts" / "tb_curves_svg.py"
    spec = importlib.util.spec_from_file_location("tb_curves_svg", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(out), str(tmp_path / "curves.svg")]) == 0
    svg = ET.parse(tmp_path / "curves.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    # lines: stage 1's throughput; memory: the budget, 2 predicted, stage 1's measured (stage 3: one point,
    # a dot); and the 2 out-of-memory trials as crosses
    assert len(svg.findall(f"{ns}polyline")) == 1 + 4 and len(svg.findall(f"{ns}path")) == 2
