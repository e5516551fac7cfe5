"""What a search under toolkit.run logs while it runs (toolkit.run.progress_line): each running trial's
latest report, the trials left and a rough time left (its arithmetic: tests/launch/test_progress.py).
Pure functions and files; the real concurrent search that logs them is tests/run/test_scheduler.py's."""

import json
from types import SimpleNamespace

from toolkit.run import searchers
from toolkit.run.progress_line import latest_report, progress_line, report_text


def test_a_trials_latest_report_is_the_last_whole_line_of_its_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert latest_report(path) is None
    lines = [{"group": "training", "steps_completed": 10, "metrics": {"loss": 0.5}},
             {"group": "validation", "steps_completed": 20, "metrics": {"x": 12, "batches": 20, "note": "a"}}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"group": "training", "steps')
    assert latest_report(path) == lines[1]   # the torn line being written is not read
    assert report_text(lines[1], metric="x") == "step 20 validation x=12"
    assert report_text(lines[0], metric="x") == "step 10 training loss=0.5"   # not the metric: its numbers
    assert report_text(None, metric="x") == "no report yet"


def test_the_progress_line_names_each_running_trial_and_what_is_left(tmp_path):
    from toolkit.run.scheduler import _progress

    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 5}}
    state = searchers.new_state(config, seed=1)
    for _ in range(3):
        searchers.next_trial(state, config).state = "RUNNING"
    state.trials[0].state = "COMPLETED"
    (tmp_path / "trial-0001").mkdir()
    (tmp_path / "trial-0001" / "metrics.jsonl").write_text(
        json.dumps({"group": "validation", "steps_completed": 8, "metrics": {"x": 2.5}}) + "\n")
    running = {i: SimpleNamespace(trial=t, plan=SimpleNamespace(output_dir=tmp_path / t.dir), started=0.0)
               for i, t in enumerate(state.trials) if i}
    line = _progress(running, state, SimpleNamespace(config=config), [100.0], 2)
    assert line.startswith("searcher: 2 running (trial-0001 step 8 validation x=2.5; trial-0002 no report "
                           "yet), 1 done; up to 2 more trials, about ")
    assert progress_line([], done=0, to_start=1, durations=[], elapsed=[], concurrency=1).endswith(
        "time left unknown until a trial ends")


def test_lines_that_are_no_report_are_passed_over(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = {"group": "training", "steps_completed": 4, "metrics": {"loss": 1.5}}
    no_metrics = json.dumps({"group": "training", "metrics": 3})
    path.write_text(json.dumps(good) + "\nnot json\n" + no_metrics + "\n[1]\n")
    assert latest_report(path) == good
    path.write_text("garbage\n" + json.dumps({"steps_completed": 1}) + "\n")
    assert latest_report(path) is None
