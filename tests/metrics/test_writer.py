"""Tests for toolkit.metrics.writer: input checks and files in one process, averaging with 2 gloo ranks."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

import toolkit.metrics.writer as metrics_module
from helpers import procutil
from toolkit.errors import ConfigError
from toolkit.metrics.writer import SAMPLES_PER_SECOND, MetricsSettings, MetricsWriter
from toolkit.runtime.context import DistributedContext

ROOT = procutil.REPO
WORKER = ROOT / "tests" / "workers" / "metrics_worker.py"


def _context(rank: int = 0) -> DistributedContext:
    # World size 1: the collectives are no-ops, so the writer runs without a process group.
    return DistributedContext(rank=rank, local_rank=rank, world_size=1, local_world_size=1,
                              node_rank=0, num_nodes=1, device=torch.device("cpu"),
                              backend="gloo", launcher="none")


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``log_dir``, read back with TensorBoard's own reader, as (step, value)."""
    acc = event_accumulator.EventAccumulator(str(log_dir),
                                             size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def writer(tmp_path):
    with MetricsWriter(_context(), tmp_path / "logs", reduce_every=1) as w:
        yield w


# -- input checks (before any collective) -------------------------------------------------------

@pytest.mark.parametrize("value, error, words", [
    (None, TypeError, ["'loss'", "NoneType", "real number"]),
    ("0.5", TypeError, ["'loss'", "str", "real number"]),
    ([1.0, 2.0], TypeError, ["'loss'", "list"]),
    (torch.ones(2), ValueError, ["'loss'", "shape (2,)", "0-d or one-element"]),
    (np.zeros((2, 2)), ValueError, ["'loss'", "shape (2, 2)"]),
    (torch.tensor(1 + 2j), ValueError, ["'loss'", "complex"]),
])
def test_bad_value_names_key_type_and_expectation(writer, value, error, words):
    with pytest.raises(error) as info:
        writer.report_training_metrics(1, {"acc": 1.0, "loss": value})
    for word in words:
        assert word in str(info.value)


def test_bad_batch_metric_names_its_index(writer):
    with pytest.raises(TypeError, match=r"batch_metrics\[1\]: metric 'loss' is NoneType"):
        writer.report_training_metrics(2, {"acc": 1.0}, batch_metrics=[{"loss": 1.0}, {"loss": None}])


@pytest.mark.parametrize("steps, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError),
                                          (torch.tensor(3), TypeError)])
def test_steps_completed_must_be_a_non_negative_int(writer, steps, error):
    with pytest.raises(error, match="steps_completed"):
        writer.report_validation_metrics(steps, {"loss": 1.0})


def test_other_bad_inputs(writer):
    with pytest.raises(ValueError, match="samples=-1"):
        writer.report_training_metrics(1, {"loss": 1.0}, samples=-1)
    with pytest.raises(ValueError, match="at most 1"):
        writer.report_training_metrics(1, {"loss": 1.0}, batch_metrics=[{"l": 1.0}, {"l": 2.0}])
    with pytest.raises(ValueError, match="samples_per_second"):
        writer.report_training_metrics(1, {SAMPLES_PER_SECOND: 1.0}, samples=3)
    with pytest.raises(ValueError, match="empty"):
        writer.report_validation_metrics(1, {})
    with pytest.raises(TypeError, match="expected a dict"):
        writer.report_validation_metrics(1, [("loss", 1.0)])


@pytest.mark.parametrize("kwargs, field", [
    ({"jsonl_name": "sub/metrics.jsonl"}, "jsonl_name"), ({"jsonl_name": ""}, "jsonl_name"),
    ({"flush_every": 0}, "flush_every"), ({"flush_secs": 0}, "flush_secs"),
    ({"resume_step": -3}, "resume_step"),
    ({"reduce_every": 0}, "reduce_every"), ({"reduce_every": 2.0}, "reduce_every"),
    ({"reduce_secs": 0}, "reduce_secs"), ({"reduce_secs": math.inf}, "reduce_secs"),
])
def test_settings_are_validated(tmp_path, kwargs, field):
    (key, value), = kwargs.items()
    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r}: expected")):
        MetricsSettings(**kwargs)
    with pytest.raises(ConfigError, match=field):
        MetricsWriter(_context(), tmp_path, **kwargs)
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_settings_list_every_problem_at_once():
    with pytest.raises(ConfigError) as caught:
        MetricsSettings(jsonl_name="a/b", flush_every=0, flush_secs=-1, reduce_every=True,
                        reduce_secs=math.nan, resume_step=-3)
    assert [p.split("=")[0] for p in caught.value.problems] == [
        "jsonl_name", "flush_every", "reduce_every", "resume_step", "flush_secs", "reduce_secs"]
    assert MetricsSettings(flush_every=np.int64(3), resume_step=np.int32(4)).flush_every == 3


def test_unknown_setting_and_bad_context(tmp_path):
    with pytest.raises(TypeError, match="flush_evry"):
        MetricsWriter(_context(), tmp_path, flush_evry=3)
    with pytest.raises(TypeError, match="DistributedContext"):
        MetricsWriter(str(tmp_path), tmp_path)


# -- values, files ------------------------------------------------------------------------------

def test_scalar_kinds_are_accepted_and_written(tmp_path):
    log_dir = tmp_path / "logs"
    values = {"zero_d": torch.tensor(0.5, requires_grad=True) * 1, "one_elem": torch.tensor([2.0]),
              "np_scalar": np.float32(0.25), "np_array": np.array([3]), "int": 7, "flag": True,
              "f64": torch.tensor(1e-12, dtype=torch.float64)}
    with MetricsWriter(_context(), log_dir, reduce_every=1) as w:
        returned = w.report_training_metrics(3, values)
    expected = {"zero_d": 0.5, "one_elem": 2.0, "np_scalar": 0.25, "np_array": 3.0, "int": 7.0,
                "flag": 1.0, "f64": 1e-12}
    assert returned == expected
    [line] = _lines(log_dir / "metrics.jsonl")
    assert line["metrics"] == expected
    scalars = _scalars(log_dir)
    assert set(scalars) == {f"training/{k}" for k in expected}
    assert scalars["training/zero_d"] == [(3, 0.5)]


def test_jsonl_lines_and_tensorboard_tags(tmp_path):
    log_dir = tmp_path / "logs"
    before = time.time()
    with MetricsWriter(_context(), log_dir, jsonl_name="m.jsonl", reduce_every=1) as w:
        w.report_training_metrics(2, {"loss": 0.5, "acc": 0.1},
                                  batch_metrics=[{"loss": 0.7}, {"loss": 0.3}])
        w.report_validation_metrics(2, {"loss": 0.4})
        w.report_training_metrics(4, {"loss": 0.25, "acc": 0.2})
    lines = _lines(log_dir / "m.jsonl")
    assert [(x["group"], x["steps_completed"]) for x in lines] == [
        ("training", 2), ("validation", 2), ("training", 4)]
    assert lines[0]["metrics"] == {"acc": 0.1, "loss": 0.5}
    assert lines[0]["batch_metrics"] == [{"steps_completed": 1, "metrics": {"loss": 0.7}},
                                         {"steps_completed": 2, "metrics": {"loss": 0.3}}]
    assert "batch_metrics" not in lines[2]
    assert all(before <= x["time"] <= time.time() for x in lines)
    scalars = _scalars(log_dir)
    assert scalars["training/loss"] == [(2, 0.5), (4, 0.25)]
    assert scalars["validation/loss"] == [(2, pytest.approx(0.4))]
    assert scalars["training_batch/loss"] == [(1, pytest.approx(0.7)), (2, pytest.approx(0.3))]
    assert sorted(p.name for p in log_dir.iterdir() if "tfevents" not in p.name) == ["m.jsonl"]


def test_nan_and_inf_are_written_and_warned_once_per_key(tmp_path, caplog):
    log_dir = tmp_path / "logs"
    with caplog.at_level(logging.WARNING, logger="toolkit.metrics.writer"):
        with MetricsWriter(_context(), log_dir, reduce_every=1) as w:
            w.report_training_metrics(1, {"loss": math.nan, "acc": 1.0})
            w.report_training_metrics(2, {"loss": math.nan, "acc": math.inf})
            w.report_training_metrics(3, {"loss": math.inf, "acc": -math.inf})
            w.report_validation_metrics(3, {"loss": math.nan})
    warned = [r.getMessage() for r in caplog.records if r.name == "toolkit.metrics.writer"]
    assert len(warned) == 3, warned
    assert "training/loss is nan at step 1" in warned[0]
    assert "training/acc is inf at step 2" in warned[1]
    assert "validation/loss is nan at step 3" in warned[2]
    lines = _lines(log_dir / "metrics.jsonl")
    assert math.isnan(lines[0]["metrics"]["loss"]) and lines[2]["metrics"]["acc"] == -math.inf
    assert math.isinf(_scalars(log_dir)["training/loss"][2][1])


def test_samples_per_second_from_the_clock_between_reports(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics_module, "_monotonic", lambda: clock[0])
    with MetricsWriter(_context(), tmp_path, reduce_every=1) as w:
        clock[0] = 102.0                       # 2 s since the writer was created
        assert w.report_training_metrics(1, {}, samples=64) == {SAMPLES_PER_SECOND: 32.0}
        clock[0] = 106.0                       # validation time is left out of the next interval
        w.report_validation_metrics(1, {"loss": 1.0})
        clock[0] = 107.0
        assert w.report_training_metrics(2, {"loss": 1.0}, samples=10)[SAMPLES_PER_SECOND] == 10.0
    assert _scalars(tmp_path)["training/samples_per_second"] == [(1, 32.0), (2, 10.0)]


def test_reports_are_buffered_and_flushed_every_n(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(_context(), tmp_path, flush_every=3, flush_secs=3600, reduce_every=1)
    w.report_training_metrics(1, {"loss": 1.0})
    w.report_training_metrics(2, {"loss": 1.0})
    assert path.read_text() == ""              # no flush (no system call) per report
    w.report_training_metrics(3, {"loss": 1.0})
    assert len(_lines(path)) == 3
    w.report_training_metrics(4, {"loss": 1.0})
    w.flush()
    assert len(_lines(path)) == 4
    w.close()


def test_training_reports_are_averaged_in_batches_of_reduce_every(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(_context(), tmp_path, flush_every=1, reduce_every=3)
    assert w.report_training_metrics(1, {"loss": 1.0}) is None
    assert w.report_training_metrics(2, {"loss": 2.0}) is None
    assert path.read_text() == ""              # waiting for the batch
    assert w.report_training_metrics(3, {"loss": 3.0}) == {"loss": 3.0}
    assert [x["steps_completed"] for x in _lines(path)] == [1, 2, 3]
    assert w.report_training_metrics(4, {"loss": 4.0}) is None
    # A validation report averages what is pending, in report order, then itself.
    assert w.report_validation_metrics(4, {"acc": 0.5}) == {"acc": 0.5}
    groups = [(x["group"], x["steps_completed"]) for x in _lines(path)]
    assert groups[3:] == [("training", 4), ("validation", 4)]
    w.report_training_metrics(5, {"loss": 5.0})
    w.close()                                  # writes the pending report
    assert _scalars(tmp_path)["training/loss"] == [(s, float(s)) for s in range(1, 6)]


def test_adaptive_batches_hold_about_reduce_secs_of_reports(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics_module, "_monotonic", lambda: clock[0])
    returned = []
    with MetricsWriter(_context(), tmp_path, reduce_secs=1.0) as w:   # reduce_every=None: adaptive
        for step in range(1, 34):
            # A report every 0.1 s: batches of 1 (the first), 10, 10; then every 2 s: the batch
            # of 10 in flight completes, and the next ones hold a single report.
            clock[0] += 0.1 if step <= 21 else 2.0
            returned.append(w.report_training_metrics(step, {"loss": float(step)}) is not None)
        assert [i + 1 for i, r in enumerate(returned) if r] == [1, 11, 21, 31, 32, 33]
        w.report_training_metrics(34, {"loss": 34.0})
    assert [s for s, _ in _scalars(tmp_path)["training/loss"]] == list(range(1, 35))


def test_an_exception_drops_the_pending_reports_without_a_collective(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="toolkit.metrics.writer"), pytest.raises(KeyError):
        with MetricsWriter(_context(), tmp_path, reduce_every=10) as w:
            w.report_training_metrics(1, {"loss": 1.0})
            w.report_training_metrics(2, {"loss": 1.0})
            raise KeyError("the loop failed")
    assert "dropping 2 metric reports not averaged yet (steps 1-2)" in caplog.text
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    with pytest.raises(RuntimeError, match="closed"):
        w.report_training_metrics(3, {"loss": 1.0})


def test_waiting_reports_leave_no_object_for_the_garbage_collector(tmp_path):
    # Hundreds of reports wait for their batch's collective; had each left a tracked object
    # (as a list of report objects did), the cyclic GC would run full passes over the whole
    # training process: ~2.5% of a 30 ms step in scripts/bench_overhead.py.
    import gc

    loss = torch.tensor(0.25)
    with MetricsWriter(_context(), tmp_path, reduce_every=1000) as w:
        w.report_training_metrics(1, {"loss": loss, "lr": 1e-3}, samples=8)  # first of its kind
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            for step in range(2, 502):
                w.report_training_metrics(step, {"loss": loss, "lr": 1e-3}, samples=8)
            grown = len(gc.get_objects()) - before
        finally:
            gc.enable()
        assert len(w._pending) == 501
    assert grown < 10, f"{grown} tracked objects for 500 waiting reports"
    lines = _lines(tmp_path / "metrics.jsonl")
    assert [line["steps_completed"] for line in lines] == list(range(1, 502))
    assert lines[-1]["metrics"]["loss"] == 0.25 and lines[-1]["metrics"]["lr"] == 1e-3


def test_context_manager_closes_and_later_reports_raise(tmp_path):
    with MetricsWriter(_context(), tmp_path, flush_every=1000, flush_secs=3600) as w:
        w.report_training_metrics(5, {"loss": 1.0})
    assert len(_lines(tmp_path / "metrics.jsonl")) == 1
    assert _scalars(tmp_path)["training/loss"] == [(5, 1.0)]
    with pytest.raises(RuntimeError, match="closed"):
        w.report_training_metrics(6, {"loss": 1.0})
    w.close()                                  # idempotent


def test_resume_step_hides_the_interrupted_runs_later_points(tmp_path):
    with MetricsWriter(_context(), tmp_path) as w:
        for step in range(1, 6):
            w.report_training_metrics(step, {"loss": 1.0})
    time.sleep(1.1)  # event file names start with the second; the reader orders files by name
    # The checkpoint was taken at steps_completed=3: the resumed run reports steps 4 and 5 again.
    with MetricsWriter(_context(), tmp_path, resume_step=3) as w:
        for step in range(4, 6):
            w.report_training_metrics(step, {"loss": 2.0})
    assert _scalars(tmp_path)["training/loss"] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]
    assert len(_lines(tmp_path / "metrics.jsonl")) == 7  # appended, never truncated


def test_non_chief_creates_no_file(tmp_path):
    log_dir = tmp_path / "logs"
    with MetricsWriter(_context(rank=1), log_dir, reduce_every=1) as w:
        assert w.report_training_metrics(1, {"loss": 0.5}) == {"loss": 0.5}
    assert not log_dir.exists()


# -- two real gloo ranks --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("metrics2")
    log_dir, out_dir = base / "logs", base / "out"
    out_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_free_port()), str(WORKER), str(log_dir), str(out_dir)]
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return base, log_dir, records


def test_two_ranks_average_is_written_once_by_the_chief(two_ranks):
    base, log_dir, _ = two_ranks
    names = sorted(p.name for p in log_dir.iterdir())
    assert len(names) == 2 and names[1] == "metrics.jsonl" and "tfevents" in names[0], names
    # Each rank gave its own directory: only the chief's exists.
    assert (base / "per_rank_0").is_dir() and not (base / "per_rank_1").exists()

    scalars = _scalars(log_dir)
    assert set(scalars) == {"training/loss", "training/acc", "training/count",
                            "training/samples_per_second", "training_batch/batch_loss",
                            "validation/val_loss"}
    assert scalars["training/loss"] == [(2, 2.5), (4, 4.5), (6, 6.5), (8, 8.5), (10, 1.5)]
    for tag, value in [("training/acc", 0.125), ("training/count", 1.5),
                       ("training/samples_per_second", 20.0)]:
        assert scalars[tag] == [(s, value) for s in (2, 4, 6, 8)], tag
    assert scalars["training_batch/batch_loss"] == [(s, s + 50.0) for s in range(1, 9)]
    assert scalars["validation/val_loss"] == [(4, 1.5), (8, 1.5)]

    lines = _lines(log_dir / "metrics.jsonl")
    assert [(x["group"], x["steps_completed"]) for x in lines] == [
        ("training", 2), ("training", 4), ("validation", 4), ("training", 6), ("training", 8),
        ("validation", 8), ("training", 10)]
    assert lines[0]["metrics"] == {"acc": 0.125, "count": 1.5, "loss": 2.5, SAMPLES_PER_SECOND: 20.0}
    assert lines[0]["batch_metrics"] == [{"steps_completed": 1, "metrics": {"batch_loss": 51.0}},
                                         {"steps_completed": 2, "metrics": {"batch_loss": 52.0}}]


def test_two_ranks_return_the_same_averages(two_ranks):
    _, log_dir, records = two_ranks
    assert records[0]["returned"] == records[1]["returned"]
    written = [[x["group"], x["steps_completed"], x["metrics"]] for x in _lines(log_dir / "metrics.jsonl")]
    assert records[0]["returned"] == written


def test_two_ranks_one_collective_per_report_once_names_are_agreed(two_ranks):
    _, _, records = two_ranks
    for record in records:
        # The first report of a group (and of a new set of names) agrees on the names: 3 calls.
        assert record["collectives"] == [
            ["training", 2, 3], ["training", 4, 1], ["validation", 4, 3], ["training", 6, 1],
            ["training", 8, 1], ["validation", 8, 1], ["training", 10, 3]]


def test_two_ranks_batched_one_collective_per_batch(two_ranks):
    base, _, records = two_ranks
    for record in records:
        counts = [(kind, step, n) for kind, step, n, _ in record["batched"]]
        # Steps 4 and 8 complete batches (the first agrees on the names: 3 calls); validation at
        # 9 averages the pending step 9 with itself (a new group: 3 calls); close() steps 10-11.
        assert counts == [("training", s, {4: 3, 8: 1}.get(s, 0)) for s in range(1, 10)] + [
            ("validation", 9, 3), ("close", 11, 1)], counts
        returned = {(kind, step): out for kind, step, _, out in record["batched"]}
        assert returned[("training", 4)] == {"loss": 4.5} and returned[("training", 3)] is None
        assert returned[("validation", 9)] == {"val": 0.5}
    lines = _lines(base / "batched" / "metrics.jsonl")
    assert [(x["group"], x["steps_completed"]) for x in lines] == (
        [("training", s) for s in range(1, 10)] + [("validation", 9), ("training", 10), ("training", 11)])
    losses = [x["metrics"]["loss"] for x in lines if x["group"] == "training"]
    assert losses == [s + 0.5 for s in range(1, 12)]
    assert _scalars(base / "batched")["training/loss"] == [(s, s + 0.5) for s in range(1, 12)]


def test_two_ranks_disagreeing_ranks_all_raise_instead_of_hanging(two_ranks):
    _, _, records = two_ranks
    for record in records:
        names, steps = record["errors"]["names"], record["errors"]["steps"]
        assert names is not None and "different metrics" in names
        assert "rank 0: training metrics ['acc', 'count', 'loss']" in names
        assert "rank 1: training metrics ['loss']" in names
        assert steps is not None and "different steps_completed [[9], [10]]" in steps
        batched = record["errors"]["batched_names"]
        assert batched is not None and "rank 1: training metrics ['other']" in batched, batched
