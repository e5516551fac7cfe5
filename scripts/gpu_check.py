"""GPU check: the toolkit end to end on a CUDA machine, in one command.

    .venv/bin/python scripts/gpu_check.py [--out DIR] [--quick] [--parts build examples oom gpt2]

1. builds DeepSpeed's FusedAdam once (DeepSpeed JIT-builds it on CUDA; better serially, here);
2. runs examples/core_api/{train,pipeline,mlm,causal_lm}.py on every GPU (torchrun, nccl), once
   with bf16 and once with fp16 (a copy of each example's YAML whose ``overwrite_deepspeed_args``
   turns the precision on), and reads samples/s from each run's ``tensorboard/metrics.jsonl``;
3. forces a real CUDA out-of-memory: a generated trial script allocates 1.5x the GPU's memory
   inside ``toolkit.dsat_reporting_context`` from micro-batch 2 on; dsat must record "oom";
4. runs dsat on causal_lm.py at GPT-2 small's size (d_model 768, 12 layers, 12 heads, sequences
   of 1024, vocabulary 50257) in bf16;
5. prints one table: throughput, MFU (model FLOPs/s per GPU over the GPU's peak bf16 dense FLOPS)
   and the predicted / found largest micro-batch of each ZeRO stage.

Everything lands in --out (default runs/gpu_check): logs/, one directory per part. Every process
has a time limit; a failed part is a "FAILED" row with its last error line, and the exit status
is 1 when any part failed. Where one command may run 10 minutes at most, use --quick and split
the parts over two commands (``--parts build examples``, then ``--parts oom gpt2``; the same
--out), and give each a ``--deadline`` inside that length: the table is printed even when a part
is stopped there. Without CUDA it says so and exits 0.
MFU cells: "6N" is 6 x parameters x tokens/s per GPU (causal_lm only: the other examples have no
parameter count from outside), "dsat" is the best trial's FLOPS_per_gpu; both over the peak.
Only public interfaces are used: the launchers, the examples' flags, dsat's CLI and output files.
One file on purpose (a script, past the 400 lines of a library module): pure pieces first, tested
in tests/test_gpu_check.py, then the thin shells that start processes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "core_api"
EXAMPLE_RUNS = (("train", "deepspeed.yaml"), ("pipeline", "pipeline.yaml"), ("mlm", "mlm.yaml"),
                ("causal_lm", "causal_lm.yaml"))
PRECISIONS = ("bf16", "fp16")
#: Peak dense bf16 FLOPS per GPU (vendor data sheets), matched against torch's device name.
PEAK_BF16_FLOPS = ((r"\bH100\b.*\bPCIe\b", 756e12), (r"\bH100\b.*\b(SXM|HBM3)", 989e12),
                   (r"\bH200\b", 989e12), (r"\bA100\b", 312e12))
GPT2_SMALL = {"vocab_size": 50257, "seq_len": 1024, "d_model": 768, "num_layers": 12, "num_heads": 12}
GPT2_SIZE_KEYS = ("vocab_size", "seq_len", "d_model", "num_layers")   # gpt2_num_params' arguments
OOM_FROM_MICRO_BATCH = 2
PARTS = ("build", "examples", "oom", "gpt2")   # --parts: FusedAdam, the examples, dsat OOM, dsat GPT-2
RUN_MARK = "GPU_CHECK_RUN"   # in every child's environment, to find what a timed-out launcher left


@dataclasses.dataclass
class Row:
    """One line of the final table."""

    part: str
    ok: bool
    samples_per_s: float | None = None
    mfu: str = "n/a"
    micro_batch: str = "-"
    note: str = ""


# ---- pure pieces -------------------------------------------------------------------------------

def peak_bf16_flops(device_name: str) -> float | None:
    """The peak dense bf16 FLOPS of a GPU named ``device_name``; None when it is not in the table."""
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def gpt2_num_params(*, vocab_size: int, seq_len: int, d_model: int, num_layers: int) -> int:
    """Parameters of a GPT-2 (tied output embedding): 124,439,808 at GPT-2 small's size."""
    per_layer = 12 * d_model * d_model + 13 * d_model   # attention 4d^2+4d, MLP 8d^2+5d, 2 layer norms 4d
    return vocab_size * d_model + seq_len * d_model + num_layers * per_layer + 2 * d_model


def model_flops_per_gpu(num_params: int, tokens_per_second: float, *, gpus: int) -> float:
    """Training FLOPs/s per GPU by the 6 * parameters * tokens rule (forward 2N, backward 4N)."""
    return 6.0 * num_params * tokens_per_second / gpus


def mfu_text(flops_per_gpu: float | None, peak: float | None) -> str:
    """'41.3%' for ``flops_per_gpu / peak``; 'n/a' when either is unknown."""
    if flops_per_gpu is None or not peak:
        return "n/a"
    return f"{100.0 * flops_per_gpu / peak:.1f}%"


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` deep-copied with ``extra`` merged in recursively (neither is changed)."""
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = merged(out[key], value) if both else copy.deepcopy(value)
    return out


def write_experiment_copy(src: Path, dst: Path, *, ds_overrides: Mapping[str, Any],
                          hparams: Mapping[str, Any], slots: int | None = None) -> dict[str, Any]:
    """Write to ``dst`` the experiment YAML ``src`` with ``ds_overrides`` merged into its
    ``overwrite_deepspeed_args`` (e.g. ``{"bf16": {"enabled": True}}``), ``hparams`` into its
    ``hyperparameters`` and, given, ``slots`` as ``resources.slots_per_trial``. Returns it."""
    config = yaml.safe_load(src.read_text(encoding="utf-8")) or {}
    hyper = merged(config.get("hyperparameters") or {}, hparams)
    hyper["overwrite_deepspeed_args"] = merged(hyper.get("overwrite_deepspeed_args") or {}, ds_overrides)
    config = {**config, "hyperparameters": hyper}
    if slots is not None:
        config = merged(config, {"resources": {"slots_per_trial": slots}})
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return config


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; a missing file or a malformed line gives nothing."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def throughput(lines: Iterable[Mapping[str, Any]]) -> float | None:
    """Median training ``samples_per_second`` of a metrics.jsonl, its first fifth (warm-up) left out."""
    values = [float(line["metrics"]["samples_per_second"]) for line in lines
              if line.get("group") == "training"
              and isinstance((line.get("metrics") or {}).get("samples_per_second"), (int, float))]
    values = values[len(values) // 5:]
    return statistics.median(values) if values else None


def trial_stage(trial: Mapping[str, Any]) -> int | None:
    """A trial record's ZeRO stage: ``stage``, else its ``ds_overrides.zero_optimization.stage``."""
    stage = trial.get("stage")
    if stage is None:
        stage = ((trial.get("ds_overrides") or {}).get("zero_optimization") or {}).get("stage")
    return stage if isinstance(stage, int) else None


def largest_ok_micro_batch(trials: Iterable[Mapping[str, Any]]) -> dict[int | None, int]:
    """Per ZeRO stage, the largest ``micro_batch`` of the trials with status "ok"."""
    found: dict[int | None, int] = {}
    for trial in trials:
        micro = trial.get("micro_batch")
        if trial.get("status") == "ok" and isinstance(micro, int):
            stage = trial_stage(trial)
            found[stage] = max(found.get(stage, 0), micro)
    return found


def predicted_micro_batch(profile: Mapping[str, Any]) -> dict[int, int] | str:
    """Per stage, the memory model's largest micro-batch from profile.json's ``prediction``
    (``approx_max_micro_batch``, or any ``*max_micro_batch*`` field); without one, the
    top-level keys the file has (so the table shows what there is)."""
    prediction = profile.get("prediction")
    out: dict[int, int] = {}
    if isinstance(prediction, Mapping):
        for stage, fields in prediction.items():
            if not (isinstance(fields, Mapping) and str(stage).isdigit()):
                continue
            keys = ["approx_max_micro_batch"] + sorted(k for k in fields if "max_micro_batch" in str(k))
            value = next((fields[k] for k in keys if isinstance(fields.get(k), int)), None)
            if value is not None:
                out[int(stage)] = value
    return out or "no prediction; profile.json has: " + (", ".join(map(str, profile)) or "nothing")


def micro_batch_text(predicted: dict[int, int] | str, found: Mapping[int | None, int]) -> str:
    """'s1 824/389 s2 825/-': predicted / found per stage ('-' where there is none)."""
    pred: dict[int | None, int] = {k: v for k, v in predicted.items()} if isinstance(predicted, dict) else {}
    stages = sorted(set(pred) | set(found), key=lambda s: -1 if s is None else s)
    text = " ".join(f"s{'?' if s is None else s} {pred.get(s, '-')}/{found.get(s, '-')}" for s in stages)
    if isinstance(predicted, str):
        text = f"{text} ({predicted})" if text else predicted
    return text or "-"


def oom_verdict(trials: Iterable[Mapping[str, Any]], *, oom_from: int) -> tuple[bool, str]:
    """Did dsat record every trial at micro-batch >= ``oom_from`` (which allocated 1.5x the
    GPU's memory) as "oom"? At least one must have run."""
    big = [t for t in trials if isinstance(t.get("micro_batch"), int) and t["micro_batch"] >= oom_from]
    wrong = [t for t in big if t.get("status") != "oom"]
    if not big:
        return False, f"no trial ran at micro-batch >= {oom_from}"
    if wrong:
        shown = ", ".join(f"trial {t.get('trial_id')} mb {t['micro_batch']} {t.get('status')}" for t in wrong)
        return False, f"not recorded as oom: {shown}"
    return True, f"{len(big)} trial(s) at micro-batch >= {oom_from} recorded as oom"


def last_error_line(text: str) -> str:
    """The line of a log that best says why a process failed: the last 'SomethingError: ...' line
    (launcher prefixes such as '[rank0]: ' removed; torchrun's own ChildFailedError skipped, it
    only says that a worker failed), else the last non-empty line."""
    lines = [re.sub(r"^\[(rank|default)\d*\]:\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b:?", line)
              and "ChildFailedError" not in line]
    return ((errors or lines or [""])[-1])[:200]


def format_table(rows: Iterable[Row]) -> str:
    """The final table, one row per part, columns padded to their widest cell."""
    header = ("part", "status", "samples/s", "MFU", "micro-batch pred/found", "note")
    cells = [header] + [(r.part, "ok" if r.ok else "FAILED",
                         "-" if r.samples_per_s is None else f"{r.samples_per_s:,.1f}",
                         r.mfu, r.micro_batch, r.note) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def best_trial(trials: Iterable[Mapping[str, Any]], best_metrics: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record of best_ds_metrics.json's ``trial_id``; without one, the ok trial of highest
    throughput; None when no trial is ok."""
    ok = [dict(t) for t in trials if t.get("status") == "ok"]
    chosen = [t for t in ok if t.get("trial_id") == best_metrics.get("trial_id")]
    return chosen[0] if chosen else max(ok, key=lambda t: float(t.get("throughput") or 0.0), default=None)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when it is missing or not a JSON object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def part_limit(timeout: float, left: float) -> float:
    """A part's time limit: ``timeout``, or the ``left`` seconds before the deadline when fewer
    (at least 1 s: a part is started only while time is left).

    >>> part_limit(900, 120.5), part_limit(300, 1e9), part_limit(300, -5)
    (120.5, 300, 1.0)
    """
    return max(1.0, min(timeout, left))


def failure_note(rc: int | None, log: str, *, timeout: float) -> str:
    """Why a process failed, in one line."""
    where = f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}"
    return f"{where}: {last_error_line(log)}"


# ---- effects -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Check:
    """What every part needs: where to write, how long to run, the GPUs, the children's environment."""

    out: Path
    quick: bool
    gpus: int
    device_name: str
    env: dict[str, str]
    deadline: float | None = None   # time.monotonic() by which every part has ended (--deadline)

    @property
    def peak(self) -> float | None:
        return peak_bf16_flops(self.device_name)

    def limit(self, timeout: float) -> float:
        """``timeout``, cut to what is left before the deadline (SIGTERM/SIGINT and a minute's grace
        are still to come after it, so a part stopped there ends a little later)."""
        return timeout if self.deadline is None else part_limit(timeout, self.deadline - time.monotonic())

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_marked(mark: str) -> None:
    """SIGKILL every process whose environment carries ``RUN_MARK=mark``: what one launch of this
    script started (torchrun's workers live in sessions of their own, out of its process group)."""
    needle = f"{RUN_MARK}={mark}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if needle in proc.joinpath("environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)


def run_cmd(argv: list[str], *, log: Path, timeout: float, env: Mapping[str, str],
            stop: int = signal.SIGTERM) -> tuple[int | None, str]:
    """Run ``argv`` (in the repository root) with its output in ``log``; past ``timeout`` seconds send
    ``stop`` to it (torchrun stops its workers on SIGTERM, dsat its trials on SIGINT), a minute
    later SIGKILL; then whatever it left is killed. Returns (exit status, None on timeout; log text)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    mark = uuid.uuid4().hex
    print(f"$ {' '.join(argv)}\n  (log: {log})", flush=True)
    rc: int | None = None
    with log.open("w", encoding="utf-8") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**env, RUN_MARK: mark}, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, stop)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:   # Ctrl-C here: take the launcher's group down with us
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            kill_marked(mark)         # what the launcher left, in its group or outside it
    return rc, log.read_text(encoding="utf-8", errors="replace")


def free_port() -> int:
    """A TCP port free on this machine right now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    """The environment of every child: this Python's bin first on PATH (DeepSpeed builds ops with
    the first ninja there), the tree's TORCH_EXTENSIONS_DIR, NCCL's version line in the logs."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    env.setdefault("NCCL_DEBUG", "VERSION")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def cuda_info(env: Mapping[str, str]) -> dict[str, Any]:
    """{"available", "count", "name"} from a child process, so that this one holds no CUDA context."""
    code = ("import json, torch\nok = torch.cuda.is_available()\n"
            "print(json.dumps({'available': ok, 'count': torch.cuda.device_count() if ok else 0,\n"
            "                  'name': torch.cuda.get_device_name(0) if ok else ''}))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(env), capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: could not ask torch about CUDA: {last_error_line(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_fused_adam(check: Check) -> Row:
    """DeepSpeed's FusedAdam (the examples' optimizer on CUDA), JIT-built once here, not by every rank."""
    code = ("import toolkit\n"
            "toolkit.install_build_guards()  # DeepSpeed's builder reads TORCH_CUDA_ARCH_LIST='9.0a'\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "get_accelerator().create_op_builder('FusedAdamBuilder').load()")
    timeout = check.limit(900)
    rc, log = run_cmd([sys.executable, "-c", code], log=check.out / "logs" / "fused_adam.log",
                      timeout=timeout, env=check.env)
    return Row("build FusedAdam", rc == 0, note="" if rc == 0 else failure_note(rc, log, timeout=timeout))


def run_example(check: Check, script: str, config_name: str, precision: str) -> Row:
    """One example on every GPU with ``precision`` ("bf16"/"fp16") on; samples/s from metrics.jsonl."""
    work, steps = check.out / "examples" / f"{script}_{precision}", 20 if check.quick else 60
    timeout = check.limit(600)
    hparams: dict[str, Any] = {"deterministic": False}    # throughput, not bitwise resumes
    if script == "pipeline":
        hparams["pipeline_stages"] = 2 if check.gpus % 2 == 0 else 1
    config = write_experiment_copy(EXAMPLES / config_name, work / "experiment.yaml",
                                   ds_overrides={precision: {"enabled": True}}, hparams=hparams)
    hp = config["hyperparameters"]
    shutil.rmtree(work / "run", ignore_errors=True)   # a fresh run: the examples resume from what they find
    rc, log = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(check.gpus),
                       "--master_port", str(free_port()), str(EXAMPLES / f"{script}.py"),
                       "--config", str(work / "experiment.yaml"), "--output-dir", str(work / "run"),
                       "--max-steps", str(steps)],
                      log=check.out / "logs" / f"{script}_{precision}.log", timeout=timeout, env=check.env)
    sps = throughput(read_jsonl(work / "run" / "tensorboard" / "metrics.jsonl"))
    micro = hp["overwrite_deepspeed_args"].get("train_micro_batch_size_per_gpu", "?")
    row = Row(f"{script} {precision}", rc == 0 and sps is not None, micro_batch=f"{micro} (set)")
    if rc != 0:
        row.note = failure_note(rc, log, timeout=timeout)
    if rc != 0 or sps is None:
        row.note = row.note or "no samples_per_second in metrics.jsonl"
        return row
    notes = [f"{check.gpus} GPU(s), {steps} steps", "nccl" if "NCCL version" in log else "no NCCL line"]
    if script == "pipeline":   # every rank of a replica reports the replica's samples
        sps /= hp["pipeline_stages"]
        notes.append(f"samples/s divided by {hp['pipeline_stages']} stage(s)")
    row.samples_per_s, row.note = sps, ", ".join(notes)
    if script == "causal_lm":
        flops = model_flops_per_gpu(gpt2_num_params(**{k: hp[k] for k in GPT2_SIZE_KEYS}),
                                    sps * hp["seq_len"], gpus=check.gpus)
        row.mfu = f"{mfu_text(flops, check.peak)} 6N"
    return row


OOM_TRIAL = '''"""gpu_check's trial: from micro-batch {oom_from} on, a step asks for 1.5x the GPU's memory."""
from pathlib import Path

import deepspeed
import torch

import toolkit

HERE = Path(__file__).resolve().parent
ctx = toolkit.init_distributed()
hparams = toolkit.get_hparams(HERE / "experiment.yaml")
ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size, base_dir=HERE,
                                    device=ctx.device)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
micro = engine.train_micro_batch_size_per_gpu()
total = torch.cuda.get_device_properties(ctx.device).total_memory
for step in range(1000):
    with toolkit.dsat_reporting_context(engine, steps_completed=step):
        loss = engine(torch.randn(micro, 64, device=ctx.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if micro >= hparams["oom_from_micro_batch"]:
            torch.empty(int(1.5 * total), dtype=torch.uint8, device=ctx.device)
'''


def write_oom_model(model_dir: Path) -> Path:
    """The OOM trial's script, DeepSpeed JSON (torch's Adam: no op to build) and experiment YAML."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "oom_trial.py").write_text(OOM_TRIAL.format(oom_from=OOM_FROM_MICRO_BATCH), encoding="utf-8")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": 1}, "steps_per_print": 1000000}
    (model_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2), encoding="utf-8")
    experiment = {"name": "gpu-check-oom", "entrypoint": "python3 oom_trial.py",
                  "resources": {"slots_per_trial": 1},
                  "searcher": {"metric": "loss", "smaller_is_better": True, "max_length": 100},
                  "hyperparameters": {"deepspeed_config": "ds_config.json",
                                      "oom_from_micro_batch": OOM_FROM_MICRO_BATCH}}
    (model_dir / "experiment.yaml").write_text(yaml.safe_dump(experiment, sort_keys=False), encoding="utf-8")
    return model_dir / "experiment.yaml"


def run_dsat(check: Check, name: str, config: Path, model_dir: Path, *, trials: int,
             extra: tuple[str, ...] = ()) -> tuple[int | None, str, Path, float]:
    """``python -m toolkit.dsat binary`` into ``<out>/<name>/dsat`` (emptied first), 300 s per trial.
    Returns (exit status, log text, output directory, time limit)."""
    out, trial_timeout = check.out / name / "dsat", 300
    shutil.rmtree(out, ignore_errors=True)
    timeout = check.limit((trials + 1) * trial_timeout + 180.0)   # SIGINT: dsat writes what it has
    argv = [sys.executable, "-m", "toolkit.dsat", "binary", str(config), str(model_dir), "--output-dir",
            str(out), "--max-trials", str(trials), "--trial-timeout", str(trial_timeout), *extra]
    rc, log = run_cmd(argv, log=check.out / "logs" / f"{name}.log", timeout=timeout, env=check.env,
                      stop=signal.SIGINT)
    return rc, log, out, timeout


def boundary_text(out: Path, trials: list[dict[str, Any]]) -> str:
    """Predicted (profile.json) / found (trials.jsonl) largest micro-batch per stage of a dsat run."""
    predicted = predicted_micro_batch(read_json(out / "profile.json"))
    return micro_batch_text(predicted, largest_ok_micro_batch(trials))


def oom_check(check: Check) -> Row:
    """dsat on the OOM trial: every trial at micro-batch >= OOM_FROM_MICRO_BATCH must be "oom"."""
    config = write_oom_model(check.out / "oom" / "model")
    rc, log, out, timeout = run_dsat(check, "oom", config, config.parent, trials=2 if check.quick else 3,
                                     extra=("--zero-stages", "1"))
    trials = read_jsonl(out / "trials.jsonl")
    ok, note = oom_verdict(trials, oom_from=OOM_FROM_MICRO_BATCH)
    errors = [str(t.get("error")) for t in trials if t.get("status") == "oom"]
    if errors:
        note += f" ({errors[0][:90]})"
    elif not trials:
        note = failure_note(rc, log, timeout=timeout)
    return Row("dsat CUDA OOM", ok, micro_batch=boundary_text(out, trials), note=note)


def gpt2_dsat(check: Check) -> Row:
    """dsat (binary) on causal_lm.py at GPT-2 small's size, bf16, on every GPU."""
    hparams = {**GPT2_SMALL, "dataset_size": 1_000_000, "deterministic": False}
    config = check.out / "gpt2_dsat" / "experiment.yaml"
    write_experiment_copy(EXAMPLES / "causal_lm.yaml", config, ds_overrides={"bf16": {"enabled": True}},
                          hparams=hparams, slots=check.gpus)
    rc, log, out, timeout = run_dsat(check, "gpt2_dsat", config, EXAMPLES, trials=4 if check.quick else 8)
    trials = read_jsonl(out / "trials.jsonl")
    best = best_trial(trials, read_json(out / "best_ds_metrics.json"))
    row = Row("dsat GPT-2 small bf16", rc == 0 and best is not None, micro_batch=boundary_text(out, trials))
    if best is None or rc != 0:
        row.note = failure_note(rc, log, timeout=timeout)
        return row
    row.samples_per_s = float(best.get("throughput") or 0.0) or None
    params = gpt2_num_params(**{k: hparams[k] for k in GPT2_SIZE_KEYS})
    six_n = None if row.samples_per_s is None else model_flops_per_gpu(
        params, row.samples_per_s * hparams["seq_len"], gpus=check.gpus)
    row.mfu = f"{mfu_text(best.get('FLOPS_per_gpu'), check.peak)} dsat, {mfu_text(six_n, check.peak)} 6N"
    counts = ", ".join(f"{s} {sum(t.get('status') == s for t in trials)}"
                       for s in ("ok", "oom", "failed", "timeout"))
    row.note = (f"best: trial {best.get('trial_id')}, stage {trial_stage(best)}, "
                f"mb {best.get('micro_batch')}; {counts}")
    return row


def main(argv: list[str] | None = None) -> int:
    """Run every part, print the table; 1 when a part failed, 0 otherwise or without CUDA."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check",
                        help="where runs, dsat outputs and logs go (default: runs/gpu_check)")
    parser.add_argument("--quick", action="store_true",
                        help="20 steps per example, 2 + 4 dsat trials (default: 60 steps, 3 + 8 trials)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="run only these parts, e.g. to split the check over commands of limited "
                             "length (default: all)")
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="end every part within about S seconds (a part still running then is "
                             "stopped, the parts after it are not run) and print the table; for a "
                             "device command of limited length (default: each part's own limits)")
    args = parser.parse_args(argv)
    if args.deadline is not None and args.deadline <= 0:
        parser.error(f"--deadline: expected a positive number of seconds, got {args.deadline:g}")
    env = child_env()
    info = cuda_info(env)
    if not info["available"]:
        print("gpu_check: needs CUDA (torch.cuda.is_available() is False here); nothing to check, exiting 0")
        return 0
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    check = Check(out=args.out.resolve(), quick=args.quick, gpus=int(info["count"]), device_name=info["name"],
                  env=env, deadline=deadline)
    started = time.monotonic()
    parts: list[tuple[str, Callable[[], Row]]] = []
    if "build" in args.parts:
        parts.append(("build FusedAdam", lambda: build_fused_adam(check)))
    if "examples" in args.parts:
        parts += [(f"{script} {precision}", functools.partial(run_example, check, script, name, precision))
                  for script, name in EXAMPLE_RUNS for precision in PRECISIONS]
    if "oom" in args.parts:
        parts.append(("dsat CUDA OOM", lambda: oom_check(check)))
    if "gpt2" in args.parts:
        parts.append(("dsat GPT-2 small bf16", lambda: gpt2_dsat(check)))
    rows = [Row(name, False, note=f"not run: --deadline {args.deadline:g} s reached")
            if check.past_deadline() else run_part() for name, run_part in parts]
    peak = "n/a (not in the table)" if check.peak is None else f"{check.peak / 1e12:.0f} TFLOPS"
    print(f"\n{check.gpus} x {check.device_name}, peak bf16 dense {peak}; "
          f"{time.monotonic() - started:.0f} s; logs in {check.out / 'logs'}\n\n{format_table(rows)}")
    failed = [row.part for row in rows if not row.ok]
    print(f"\n{len(failed)} part(s) failed: {', '.join(failed)}" if failed else "\nall parts passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
