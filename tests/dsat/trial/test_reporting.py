"""toolkit.dsat.trial.reporting: real DeepSpeed trials (2 ranks, torchrun, CPU) run by TrialRunner.

The worker, tests/workers/dsat_train.py, is a tiny model whose parameter count, activation bytes
and FLOPs are known exactly, with sleeps of known length inside forward, backward and the step,
and its own stopwatch around each ``with`` block. The 2-rank trials run once, two at a time, in a
module fixture; each test checks one or more of them, and each trial carries as many of the
checked properties as its verdict allows (a launch costs ~13 CPU-s, its steps little). What only
the chief shows (a failed or out-of-memory ending of its own) runs as one plain ``python`` rank
(:func:`run_alone`), classified from its exit status and result file as the runner does.
"""

import json
import os
import subprocess
import sys
import timeit

import pytest

from helpers import procutil, resets
from toolkit.dsat.contract import METRICS, MISMATCH_EXIT_STATUS, ProfileInfo, TrialContract, TrialStatus
from toolkit.dsat.execution.classify import classify
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
from toolkit.dsat.trial import reporting
from toolkit.dsat.trial.reporting import dsat_reporting_context, instrumentation_overrides
from toolkit.dsat.trial.session import extra_timed_steps
from toolkit.errors import LaunchEnvError

WORKERS = procutil.WORKERS
GIB = 1024 ** 3
START, END = 3, 5
SLEEP = {"sleep_forward_ms": 20, "sleep_backward_ms": 10, "sleep_step_ms": 15}
FWD_FLOPS_PER_EXAMPLE = 2 * 16 * 32 + 2 * 32 * 4   # the two Linear layers (torch counts matmuls; ReLU is 0)


def ds_config(*, micro_batch, stage, gas=1, trial_id=0):
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5_000_000,
            "allgather_bucket_size": 5_000_000,
        },
        "steps_per_print": 1000,
    }
    contract = TrialContract(trial_id, "unused", START, END)
    config.update(instrumentation_overrides(contract))   # what the orchestrator merges into trials
    return config


TRIALS = {
    # id: (spec, ds_config, extra hparams)
    # the one-line form, dsat_reporting_context(engine): the context counts its own calls
    2: (
        TrialSpec(2, 2, {"stage": 1}, line=0),
        ds_config(micro_batch=2, stage=1, gas=2),
        {"pipeline": True, "sleep_forward_ms": 10, "sleep_backward_ms": 5, "one_line": True},
    ),
    3: (TrialSpec(3, 2, {"stage": 2}, line=0), ds_config(micro_batch=2, stage=2), {"mock_oom_at": [4, 1]}),
    # a loop without the dsat line (as DeepSpeedExamples' scripts): the engine's own steps are timed,
    # one per optimizer boundary (2 micro-batches), the trial ended inside engine.step() after step END
    9: (TrialSpec(9, 2, {"stage": 1}, line=0), ds_config(micro_batch=2, stage=1, gas=2),
        {**SLEEP, "no_line": True}),
}
#: Trials under a timed window (--timed-window) longer than any of them: they time steps up to the
#: contract's last_profile_step, END + 4 x 3 = 17, or as far as the loop goes.
WINDOW_S, LAST = 100.0, END + 4 * (END - START + 1)
WINDOW_TRIALS = {
    # the profiling trial under ZeRO-3, timed until the window's last step; a loop resumed at step
    # 100 passing steps_completed: its warm-up and window are counted from the first call
    0: (TrialSpec(0, 1, {"stage": 3}, profile=True), ds_config(micro_batch=1, stage=3),
        {"sleep_step_ms": 10, "first_step": 100}),
    # data parallel under ZeRO-2 with sleeps in each part; the loop ends after step 9, inside the
    # window's steps: the chief reports steps 3..9
    8: (TrialSpec(8, 2, {"stage": 2}, line=0), ds_config(micro_batch=2, stage=2), {**SLEEP, "steps": 10}),
}


@pytest.fixture(scope="module")
def trials(tmp_path_factory):
    out = tmp_path_factory.mktemp("dsat")
    with pytest.MonkeyPatch.context() as mp:
        for key in list(os.environ):
            if key.startswith("TOOLKIT_") or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                     "MASTER_PORT", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
                mp.delenv(key)
        mp.setenv("OMP_NUM_THREADS", "1")
        results = {}
        for window, trials in ((0.0, TRIALS), (WINDOW_S, WINDOW_TRIALS)):
            settings = RunnerSettings(
                entrypoint=("python3", "dsat_train.py"),
                model_dir=WORKERS,
                slots_per_trial=2,
                max_slots=4,
                max_concurrent=2,
                timeout_s=280,
                memory_per_slot=8 * GIB,
                start_profile_step=START,
                end_profile_step=END,
                timed_window_s=window,   # 0: exactly the steps START..END
            )
            assert settings.last_profile_step == (LAST if window else END)
            pending = sorted(trials)
            with TrialRunner(settings, output_dir=out) as runner:
                while pending or runner.running():
                    while pending and runner.capacity():
                        spec, config, extra = trials[pending.pop(0)]
                        runner.start(
                            spec, ds_config=config, hparams={"deepspeed_config": "ignored.json", **extra}
                        )
                    results.update({r.spec.trial_id: r for r in runner.wait(timeout=300)})
    return out / "trials", results


def stopwatch(trials_dir, trial_id, rank):
    """The worker's own wall time per step, in ms, steps 0.."""
    return [
        1000 * s for s in json.loads((trials_dir / f"trial_{trial_id}" / f"stopwatch{rank}.json").read_text())
    ]


def ok(result):
    assert result.status is TrialStatus.OK, result.error
    assert set(result.metrics) == set(METRICS) and all(v > 0 for v in result.metrics.values()), result.metrics
    return result.metrics


def test_data_parallel_metrics_and_units_against_a_stopwatch(trials):
    trials_dir, results = trials
    m = ok(results[8])
    # forward/backward/latency are ms per step: at least the sleeps placed in each part
    assert m["forward"] >= SLEEP["sleep_forward_ms"] and m["backward"] >= SLEEP["sleep_backward_ms"]
    assert m["latency"] >= sum(SLEEP.values()) and m["latency"] >= m["forward"] + m["backward"]
    # the external stopwatch: the timed steps 3..9 (the loop's last) on every rank. The metric is
    # timed inside the block, so it cannot exceed the slowest rank's stopwatch mean (step 9 there
    # also holds the result writing); and it agrees with the plain steps 3..8 within timing noise.
    watches = [stopwatch(trials_dir, 8, rank) for rank in (0, 1)]
    assert all(len(w) == 10 for w in watches)
    assert m["latency"] <= max(sum(w[START:10]) / (10 - START) for w in watches) * 1.0001
    plain = max(sum(w[START:9]) / (9 - START) for w in watches)
    assert 0.5 * plain <= m["latency"] <= 3.0 * plain  # catches s-vs-ms and per-sample mistakes
    # throughput in samples/s over both ranks: micro-batch 2 x 2 ranks per step
    assert m["throughput"] == pytest.approx(2 * 2 / (m["latency"] / 1000), rel=1e-9)
    # FLOPS per rank per second: 3 x the forward FLOPs of one step on one rank, over the step time
    assert m["FLOPS_per_gpu"] * m["latency"] / 1000 == pytest.approx(3 * FWD_FLOPS_PER_EXAMPLE * 2, rel=1e-9)
    assert results[8].profile is None


def test_pipeline_engine_metrics(trials):
    trials_dir, results = trials
    m = ok(results[2])
    # 2 micro-batches per train_batch(): stage 0 sleeps 10 ms forward and 5 ms backward in each
    assert m["forward"] >= 2 * 10 and m["backward"] >= 2 * 5
    assert m["latency"] >= m["forward"] + m["backward"]
    watches = [stopwatch(trials_dir, 2, rank) for rank in (0, 1)]
    # no window: the trial ended right after end_profile_step; one-line form: the context counted its calls
    assert all(len(w) == END + 1 for w in watches)
    assert timed_steps(trials_dir, 2) == END - START + 1   # no window: the profile steps alone
    assert m["latency"] <= max(sum(w[START:END + 1]) / (END - START + 1) for w in watches) * 1.0001
    # train_batch_size = 2 x 2 micro-batches x data-parallel size 1
    assert m["throughput"] == pytest.approx(4 / (m["latency"] / 1000), rel=1e-9)
    # stage FLOPs averaged over the 2 ranks: together one model, 4 examples per step
    assert m["FLOPS_per_gpu"] * m["latency"] / 1000 == pytest.approx(
        3 * FWD_FLOPS_PER_EXAMPLE * 4 / 2, rel=1e-9
    )


def test_model_flops_per_sample_are_the_same_at_every_zero_stage(trials):
    # FLOPS_per_gpu x ranks / throughput = the model's FLOPs per sample: trial 0 runs ZeRO-3 (where
    # DeepSpeed wraps F.linear and gathers parameters in hooks), trial 2 ZeRO-1 (the pipeline
    # engine), trial 8 ZeRO-2
    _, results = trials
    per_sample = {}
    for trial_id in (0, 2, 8):
        m = ok(results[trial_id])
        per_sample[results[trial_id].spec.stage] = m["FLOPS_per_gpu"] * 2 / m["throughput"]
    print(f"\nmodel FLOPs per sample by ZeRO stage: {per_sample}")
    assert sorted(per_sample) == [1, 2, 3]
    assert max(per_sample.values()) <= 1.05 * min(per_sample.values())
    assert per_sample[3] == pytest.approx(3 * FWD_FLOPS_PER_EXAMPLE, rel=1e-9)


def test_profiling_trial_reports_the_model_under_zero3(trials):
    trials_dir, results = trials
    ok(results[0])
    info = ProfileInfo.from_json(results[0].profile)
    assert info.num_params == 16 * 32 + 32 + 32 * 4 + 4 == 676  # ZeRO-3: ds_numel, not the empty placeholders
    assert info.trainable_params == 672                         # the frozen bias
    assert info.activation_bytes_per_example == 272             # (32 + 32 + 4) float32 leaf outputs
    assert info.memory_per_slot == 8 * GIB                      # the CPU budget from the contract
    assert 50 * 1024 ** 2 < info.baseline_bytes < 4 * GIB       # interpreter + torch + DeepSpeed
    assert info.half_precision is False and info.device == "cpu"
    # the peak resident size over the whole trial (VmHWM), what the calibrated memory model uses
    assert info.micro_batch == 1 and info.baseline_bytes < info.peak_bytes < 4 * GIB and not info.calibrated
    # the start-up's peak apart (engine built, before the first step): the interpreter, torch, DeepSpeed
    assert 50 * 1024 ** 2 < info.startup_peak_bytes < 4 * GIB
    written = json.loads((trials_dir / "trial_0" / "result.json").read_text())
    assert written["status"] == "ok" and written["profile"] == results[0].profile


def test_out_of_memory_inside_the_step_is_reported(trials):
    # Mocked: torch.cuda.OutOfMemoryError raised on rank 1 at step 4 (no GPU here).
    trials_dir, results = trials
    r = results[3]
    assert r.status is TrialStatus.OOM and "CUDA out of memory" in r.error and "(mocked)" in r.error
    written = json.loads((trials_dir / "trial_3" / "result.json").read_text())
    assert written["status"] == "oom" and written["trial_id"] == 3
    # rank 1 ended inside step 4 (os._exit, no teardown): steps 0..3 are all its stopwatch saw
    assert len(stopwatch(trials_dir, 3, 1)) == 4


def run_alone(directory, monkeypatch, trial_id, hparams, *, memory_per_slot=None, checked=False):
    """One rank of dsat_train.py under plain ``python`` (no launcher: what is checked is the
    chief's own report), with a contract as the runner writes it; its result as the runner
    classifies it (:func:`classify` on the exit status and the trial directory). ``checked``: the
    contract names the trial's config, which the engine is held to (no trial bootstrap here: the
    session checks it)."""
    procutil.clean_launch_env(monkeypatch)
    from toolkit.runtime.trial_env import TRIAL_ENV, TRIAL_HPARAMS_ENV
    directory.mkdir(parents=True)
    config_path = directory / "ds_config.json"
    config_path.write_text(json.dumps(ds_config(micro_batch=2, stage=1, trial_id=trial_id)))
    (directory / "hparams.json").write_text(json.dumps({"deepspeed_config": str(config_path), **hparams}))
    TrialContract(trial_id, str(directory / "result.json"), START, END, memory_per_slot=memory_per_slot,
                  ds_config=str(config_path) if checked else None).write(directory / "trial.json")
    env = {**os.environ, TRIAL_ENV: str(directory / "trial.json"),
           TRIAL_HPARAMS_ENV: str(directory / "hparams.json")}
    with open(directory / "stderr.log", "wb") as err:
        done = subprocess.run([sys.executable, "dsat_train.py"], cwd=WORKERS, env=env, timeout=240,
                              stdout=subprocess.DEVNULL, stderr=err)
    spec = TrialSpec(trial_id, 2, {"stage": 1}, line=0)
    return done.returncode, classify(spec, directory=directory, code=done.returncode, duration_s=1.0)


def test_out_of_memory_before_the_loop_is_reported(tmp_path, monkeypatch):
    # Mocked: torch.cuda.OutOfMemoryError raised on rank 0 before deepspeed.initialize, outside any
    # step: the excepthook that toolkit.init_distributed installs in a trial
    # (toolkit.dsat.trial.install_oom_excepthook, never on import) reports it.
    code, r = run_alone(tmp_path / "trial_5", monkeypatch, 5, {"mock_oom_at": ["start", 0]})
    assert code != 0   # the exception still ends the process
    assert r.status is TrialStatus.OOM and "while placing the model (mocked)" in r.error
    assert not (tmp_path / "trial_5" / "stopwatch0.json").exists()


def test_a_loop_too_short_for_the_profile_window_fails_with_its_reason(tmp_path, monkeypatch):
    code, r = run_alone(tmp_path / "trial_4", monkeypatch, 4, {"steps": END - 1})
    assert code == 0 and r.status is TrialStatus.FAILED, (code, r)
    assert "stopped after 4 step(s)" in r.error and "end_profile_step=5" in r.error


def timed_steps(trials_dir, trial_id):
    return json.loads((trials_dir / f"trial_{trial_id}" / "result.json").read_text())["timed_steps"]


def test_short_steps_are_timed_until_the_window_or_its_last_step(trials):
    # the profiling trial 0: ZeRO-3, a 10 ms step, its loop resumed at step 100
    trials_dir, results = trials
    m = ok(results[0])
    watches = [stopwatch(trials_dir, 0, rank) for rank in (0, 1)]
    # ended after the last step the window allows, counted from the loop's first step (100: resumed)
    assert all(len(w) == LAST + 1 for w in watches)
    assert timed_steps(trials_dir, 0) == LAST - START + 1
    # the metric is the mean of every timed step, within the slowest rank's stopwatch
    assert m["latency"] <= max(sum(w[START:LAST + 1]) / (LAST - START + 1) for w in watches) * 1.0001
    assert m["latency"] >= 10   # the sleep in each step


def test_a_loop_ending_inside_the_window_reports_the_steps_it_timed(trials):
    trials_dir, results = trials
    m = ok(results[8])
    assert timed_steps(trials_dir, 8) == 10 - START   # steps 3..9, the loop's last
    chief = stopwatch(trials_dir, 8, 0)
    assert len(chief) == 10 and 10 <= m["latency"] <= sum(chief[START:]) / (10 - START) * 1.0001
    assert m["throughput"] == pytest.approx(2 * 2 / (m["latency"] / 1000), rel=1e-9)


def test_the_extra_timed_steps_fill_the_window_from_the_mean_step():
    assert extra_timed_steps([0.1] * 3, window_s=1.0, room=20) == 7
    assert extra_timed_steps([0.1] * 3, window_s=1.0, room=4) == 4      # bounded by last_profile_step
    assert extra_timed_steps([0.4, 0.3], window_s=0.7, room=20) == 0    # already spans it
    assert extra_timed_steps([0.2, 0.1], window_s=1.0, room=20) == 5    # (1.0 - 0.3) / 0.15 = 4.67
    assert extra_timed_steps([0.1] * 3, window_s=0.0, room=20) == 0
    assert extra_timed_steps([], window_s=1.0, room=20) == 0


class Untouchable:
    """An engine that fails the test if anything reads or calls it."""

    touched = []

    def __getattribute__(self, name):
        Untouchable.touched.append(name)
        raise AssertionError(f"engine.{name} was touched outside a trial")


def test_outside_a_trial_it_is_a_shared_no_op(monkeypatch):
    monkeypatch.delenv("TOOLKIT_DSAT_TRIAL", raising=False)
    resets.forget_trial_session()
    engine = Untouchable()
    first = dsat_reporting_context(engine, steps_completed=0)
    assert dsat_reporting_context(engine, steps_completed=10 ** 6) is first
    assert dsat_reporting_context(engine) is first   # the one-line form
    with first as value:
        assert value is None
    assert Untouchable.touched == []
    # The cost, measured (not asserted: timings are for benchmarks)
    per_call = min(timeit.repeat(lambda: dsat_reporting_context(engine, steps_completed=1), number=20000,
                                 repeat=3)) / 20000
    print(f"\ndsat_reporting_context outside a trial: {per_call * 1e9:.0f} ns per call")


def test_the_environment_is_read_once_per_process(monkeypatch, tmp_path):
    monkeypatch.delenv("TOOLKIT_DSAT_TRIAL", raising=False)
    resets.forget_trial_session()
    assert dsat_reporting_context(object(), steps_completed=0) is dsat_reporting_context(
        object(), steps_completed=1
    )
    monkeypatch.setenv("TOOLKIT_DSAT_TRIAL", str(tmp_path / "missing.json"))
    # memoised: setting the variable later in the same process changes nothing
    assert dsat_reporting_context(object(), steps_completed=0) is reporting._NOOP
    resets.forget_trial_session()
    with pytest.raises(LaunchEnvError, match="cannot read the trial contract"):
        dsat_reporting_context(object(), steps_completed=0)
    resets.forget_trial_session()


def test_instrumentation_overrides_only_switch_off_competing_profilers():
    overrides = instrumentation_overrides(TrialContract(1, "r.json", START, END, profile=True))
    assert overrides == {"flops_profiler": {"enabled": False}, "autotuning": {"enabled": False}}


def test_a_peak_over_the_cpu_budget_is_reported_by_the_trial_itself(tmp_path, monkeypatch):
    # No runner here (nothing polls the process): one rank whose contract holds a 64 MiB budget
    # that any torch process exceeds. The trial checks its own peak (VmHWM) before it reports, so a
    # trial that ends between two of the runner's polls is still an OOM.
    code, r = run_alone(tmp_path / "trial_7", monkeypatch, 7, {"steps": END + 2}, memory_per_slot=64 * 2**20)
    assert code == 0 and r.status is TrialStatus.OOM, (code, r)
    written = json.loads((tmp_path / "trial_7" / "result.json").read_text())
    assert written["status"] == "oom" and written["trial_id"] == 7, written
    assert r.error == written["error"]
    assert written["error"].startswith("peak RSS ") and written["error"].endswith(
        "MiB on rank 0 exceeded the memory budget 64 MiB per slot"), written["error"]


def test_a_loop_without_the_line_is_timed_by_the_engines_own_steps(trials):
    trials_dir, results = trials
    m = ok(results[9])
    written = json.loads((trials_dir / "trial_9" / "result.json").read_text())
    assert written["timed_by"] == "engine steps" and written["timed_steps"] == END - START + 1
    assert written["engine"] == {"micro_batch": 2, "gradient_accumulation_steps": 2, "stage": 1,
                                 "offload_optimizer": "none", "offload_param": "none"}  # from the engine
    # a step is an optimizer boundary: 2 micro-batches, each with its sleeps, from the end of the last one
    assert m["forward"] >= 2 * SLEEP["sleep_forward_ms"] and m["backward"] >= 2 * SLEEP["sleep_backward_ms"]
    assert m["latency"] >= 2 * sum(SLEEP.values())
    watches = [stopwatch(trials_dir, 9, rank) for rank in (0, 1)]
    # the trial ended in engine.step() of micro-batch 2 x (END + 1), on every rank
    assert all(len(w) == 2 * (END + 1) for w in watches), [len(w) for w in watches]
    plain = max(sum(w[2 * START:2 * END]) / (END - START) for w in watches)  # two micro-batches per step
    assert 0.5 * plain <= m["latency"] <= 3.0 * plain
    assert m["throughput"] == pytest.approx(2 * 2 * 2 / (m["latency"] / 1000), rel=1e-9)
    flops = 3 * FWD_FLOPS_PER_EXAMPLE * 2 * 2  # counted on step START - 1: 2 micro-batches of 2
    assert m["FLOPS_per_gpu"] * m["latency"] / 1000 == pytest.approx(flops, rel=1e-9)


def test_an_engine_built_out_of_the_hooks_sight_is_checked_when_the_session_starts(tmp_path, monkeypatch):
    # Plain python without the trial bootstrap (as a python started with -S would run): the script
    # trains micro-batch 3, its own, where the trial's config says 2. The first reporting context
    # checks the engine and ends the trial before any step is timed.
    code, r = run_alone(tmp_path / "trial_6", monkeypatch, 6, {"own_micro_batch": 3}, checked=True)
    assert code == MISMATCH_EXIT_STATUS and r.status is TrialStatus.MISMATCH, (code, r)
    assert "micro-batch: the engine runs 3, the trial is labelled 2" in r.error
    assert "deepspeed.initialize was not seen" in r.error
    assert not (tmp_path / "trial_6" / "stopwatch0.json").exists()   # no step ran
