"""scripts/gpu_check.py: its pure pieces, and its one path that runs here (no CUDA: a message, exit 0).

The GPU parts themselves need a CUDA machine (``python scripts/gpu_check.py --quick`` there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gc = _load()

# Records in the format dsat wrote on CPU (binary, 3 trials; trimmed to the fields read here).
TRIALS = [
    {"trial_id": 0, "status": "ok", "micro_batch": 1, "stage": 1, "profile": True, "throughput": 51.4,
     "FLOPS_per_gpu": 2.5e9},
    {"trial_id": 1, "status": "oom", "micro_batch": 412, "stage": 1, "throughput": None,
     "error": "RSS 1062 MiB exceeded the memory budget 1024 MiB per slot"},
    {"trial_id": 2, "status": "ok", "micro_batch": 206, "stage": 1, "throughput": 308.7,
     "FLOPS_per_gpu": 1.5e10},
]
PROFILE = {"prediction": {"1": {"approx_max_micro_batch": 824, "fits": True},
                          "2": {"approx_max_micro_batch": 825, "fits": True},
                          "3": {"approx_max_micro_batch": 825, "fits": True}},
           "profile": {"num_params": 308826, "device": "cpu"}}


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 SXM5 80GB", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 NVL", None), ("NVIDIA GeForce RTX 4090", None), ("", None)])
def test_peak_by_device_name(name, peak):
    assert gc.peak_bf16_flops(name) == peak


def test_gpt2_small_parameter_count():
    size = {k: gc.GPT2_SMALL[k] for k in gc.GPT2_SIZE_KEYS}
    assert gc.gpt2_num_params(**size) == 124_439_808    # GPT-2 small's published count


def test_gpt2_parameter_count_matches_transformers():
    transformers = pytest.importorskip("transformers")
    size = {"vocab_size": 97, "seq_len": 16, "d_model": 24, "num_layers": 3}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=24, n_layer=3, n_head=4))
    assert gc.gpt2_num_params(**size) == sum(p.numel() for p in model.parameters())


def test_mfu_arithmetic():
    flops = gc.model_flops_per_gpu(1_000_000_000, 100_000.0, gpus=2)
    assert flops == pytest.approx(3e14)                 # 6 * 1e9 * 1e5 / 2
    assert gc.mfu_text(flops, 989e12) == "30.3%"
    assert gc.mfu_text(flops, None) == "n/a"            # unknown device
    assert gc.mfu_text(None, 989e12) == "n/a"           # no FLOPs measured


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_copy_of_an_example_yaml(tmp_path, precision):
    src = REPO / "examples" / "core_api" / "mlm.yaml"
    before = src.read_text(encoding="utf-8")
    dst = tmp_path / "sub" / "experiment.yaml"
    written = gc.write_experiment_copy(src, dst, ds_overrides={precision: {"enabled": True}},
                                       hparams={"deterministic": False}, slots=4)
    assert src.read_text(encoding="utf-8") == before
    original = yaml.safe_load(before)
    assert yaml.safe_load(dst.read_text(encoding="utf-8")) == written
    overrides = written["hyperparameters"]["overwrite_deepspeed_args"]
    expected = {**original["hyperparameters"]["overwrite_deepspeed_args"], precision: {"enabled": True}}
    assert overrides == expected
    assert written["hyperparameters"]["deterministic"] is False
    assert written["hyperparameters"]["deepspeed_config"] == original["hyperparameters"]["deepspeed_config"]
    assert written["resources"] == {"slots_per_trial": 4}
    assert {k: v for k, v in written.items() if k not in ("hyperparameters", "resources")} == \
        {k: v for k, v in original.items() if k not in ("hyperparameters", "resources")}


def test_merge_is_deep_and_copies():
    base: dict[str, dict] = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5},
                             "bf16": {"enabled": False}}
    extra: dict[str, dict] = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    out = gc.merged(base, extra)
    assert out == {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5}, "bf16": {"enabled": True}}
    assert base["zero_optimization"]["stage"] == 2 and base["bf16"] == {"enabled": False}
    out["bf16"]["enabled"] = "changed"
    assert extra["bf16"]["enabled"] is True


def test_throughput_from_metrics_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"group": "training", "steps_completed": s, "metrics": {"loss": 1.0, "samples_per_second": v}}
             for s, v in enumerate([5.0, 100.0, 110.0, 90.0, 105.0], start=1)]
    lines.insert(3, {"group": "validation", "steps_completed": 3, "metrics": {"loss": 0.5}})
    path.write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n", encoding="utf-8")
    read = gc.read_jsonl(path)
    assert len(read) == 6                                # the malformed line is skipped
    assert gc.throughput(read) == 102.5                  # the first fifth (warm-up, 5.0) left out
    assert gc.throughput([{"group": "validation", "metrics": {"samples_per_second": 1.0}}]) is None
    assert gc.read_jsonl(tmp_path / "missing.jsonl") == []


def test_largest_ok_micro_batch_per_stage():
    trials = TRIALS + [
        {"trial_id": 3, "status": "failed", "micro_batch": 999, "stage": 1},
        {"trial_id": 4, "status": "ok", "micro_batch": 64,
         "ds_overrides": {"zero_optimization": {"stage": 3}}},     # stage only in the overrides
        {"trial_id": 5, "status": "timeout", "micro_batch": 128, "stage": 3}]
    assert gc.largest_ok_micro_batch(trials) == {1: 206, 3: 64}
    assert gc.largest_ok_micro_batch([]) == {}


def test_predicted_micro_batch_from_profile():
    assert gc.predicted_micro_batch(PROFILE) == {1: 824, 2: 825, 3: 825}
    renamed = {"prediction": {"2": {"predicted_max_micro_batch": 40}}}
    assert gc.predicted_micro_batch(renamed) == {2: 40}
    assert gc.predicted_micro_batch({"profile": {}}) == "no prediction; profile.json has: profile"
    assert gc.predicted_micro_batch({}) == "no prediction; profile.json has: nothing"


def test_micro_batch_text():
    found = gc.largest_ok_micro_batch(TRIALS)
    assert gc.micro_batch_text(gc.predicted_micro_batch(PROFILE), found) == "s1 824/206 s2 825/- s3 825/-"
    assert gc.micro_batch_text("no prediction; profile.json has: x", {2: 8}) == \
        "s2 -/8 (no prediction; profile.json has: x)"
    assert gc.micro_batch_text({}, {}) == "-"


def test_oom_verdict():
    ok, note = gc.oom_verdict([{"micro_batch": 1, "status": "ok"}, {"micro_batch": 40, "status": "oom"},
                               {"micro_batch": 20, "status": "oom"}], oom_from=2)
    assert ok and "2 trial(s)" in note
    ok, note = gc.oom_verdict([{"trial_id": 3, "micro_batch": 40, "status": "failed"},
                               {"micro_batch": 20, "status": "oom"}], oom_from=2)
    assert not ok and "trial 3 mb 40 failed" in note
    ok, note = gc.oom_verdict([{"micro_batch": 1, "status": "oom"}], oom_from=2)
    assert not ok and "no trial ran at micro-batch >= 2" in note


def test_best_trial():
    assert gc.best_trial(TRIALS, {"trial_id": 0})["trial_id"] == 0
    assert gc.best_trial(TRIALS, {})["trial_id"] == 2          # highest throughput
    assert gc.best_trial(TRIALS, {"trial_id": 1})["trial_id"] == 2   # an oom trial is never best
    assert gc.best_trial([t for t in TRIALS if t["status"] != "ok"], {}) is None


def test_last_error_line():
    log = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"train.py\", line 1\n"
           "[rank0]: RuntimeError: Input type (float) and bias type (c10::BFloat16) should be the same\n"
           "E1123 torch.distributed.elastic ... failed\n    raise ChildFailedError(\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n\n")
    assert gc.last_error_line(log) == ("RuntimeError: Input type (float) and bias type (c10::BFloat16) "
                                       "should be the same")
    assert gc.last_error_line("starting\nkilled\n") == "killed"
    assert gc.last_error_line("") == ""
    assert gc.failure_note(None, "x", timeout=600) == "timed out after 600 s: x"
    assert gc.failure_note(1, "torch.OutOfMemoryError: CUDA out of memory", timeout=5) == \
        "exit 1: torch.OutOfMemoryError: CUDA out of memory"


def test_table_format():
    rows = [gc.Row("train bf16", True, samples_per_s=12345.678, micro_batch="8 (set)", note="1 GPU(s), nccl"),
            gc.Row("dsat GPT-2 small bf16", False, note="exit 2: ConfigError: bad")]
    lines = gc.format_table(rows).splitlines()
    assert lines[0].split() == ["part", "status", "samples/s", "MFU", "micro-batch", "pred/found", "note"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split()[:6] == ["train", "bf16", "ok", "12,345.7", "n/a", "8"]
    assert lines[3].split()[:8] == ["dsat", "GPT-2", "small", "bf16", "FAILED", "-", "n/a", "-"]
    assert lines[3].endswith("exit 2: ConfigError: bad")
    # Columns line up: every row's status starts where the header's does.
    assert lines[2].index("ok") == lines[3].index("FAILED") == lines[0].index("status")


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "needs CUDA" in done.stdout
    assert not (tmp_path / "out").exists()


def test_docstring_gives_the_command():
    assert "python scripts/gpu_check.py [--out DIR] [--quick]" in (gc.__doc__ or "")


def test_part_limit():
    assert gc.part_limit(900, 120.5) == 120.5
    assert gc.part_limit(300, 1e9) == 300
    assert gc.part_limit(300, -5) == 1.0


def test_a_bad_deadline_is_refused():
    with pytest.raises(SystemExit) as stop:
        gc.main(["--deadline", "0"])
    assert stop.value.code == 2


def test_the_parts_after_the_deadline_are_rows_and_the_table_is_printed(tmp_path, monkeypatch, capsys):
    """The GPU is what cannot run here: cuda_info and the parts are stand-ins (a part that takes
    longer than the deadline); what is tested is main's plumbing of --deadline."""
    monkeypatch.setattr(gc, "cuda_info", lambda env: {"available": True, "count": 1, "name": "NVIDIA H200"})
    limits = []

    def slow_build(check):
        limits.append(check.limit(900))
        time.sleep(1.6)
        return gc.Row("build FusedAdam", True)

    monkeypatch.setattr(gc, "build_fused_adam", slow_build)
    monkeypatch.setattr(gc, "oom_check", lambda check: pytest.fail("started after the deadline"))
    rc = gc.main(["--out", str(tmp_path), "--parts", "build", "oom", "--deadline", "1.5"])
    out = capsys.readouterr().out
    assert rc == 1
    assert 1.0 <= limits[0] <= 1.5
    assert "build FusedAdam  ok" in out
    assert "not run: --deadline 1.5 s reached" in out and "1 part(s) failed: dsat CUDA OOM" in out
