"""Bounded input (issue 30 items 3-5): every YAML/JSON file toolkit reads, hostile or damaged.

The acceptance probes run the real CLI, ``python -m toolkit.dsat binary deepspeed.yaml .``, in
subprocesses under a 3 GB address-space cap (``RLIMIT_AS``): an alias bomb, ``1e999`` in the
DeepSpeed JSON and a non-UTF-8 YAML each exit 2 within a minute, without a traceback, and
create nothing. They run at the same time (each is mostly the interpreter's start-up).
Everything else calls the loader, the records and the CLIs' checks in this process.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

import toolkit
from helpers import procutil
from toolkit.bounded_load import (MAX_ALIASES, MAX_DEPTH, MAX_YAML_NODES, load_json, load_yaml, parse_json,
                                  parse_yaml)
from toolkit.dsat.tuner_cli import main as dsat_main
from toolkit.dsat.contract import MAX_ERROR_CHARS, METRICS, TrialStatus
from toolkit.dsat.execution.classify import classify
from toolkit.dsat.profiling_phase import ProfilingPhase
from toolkit.dsat.output_files import EventLog
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import TRIAL_FILE, load_trial_state
from toolkit.run.cli import main as run_main

MODEL = procutil.WORKERS / "dsat_model_trial.py"
DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
CAP_BYTES = 3 * 2**30


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """A few hundred bytes of YAML that expand to ``width ** levels`` strings."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def experiment(model_dir: Path, *, head: str = "", name: str = "sim", ds: str | None = None) -> Path:
    """A dsat-ready model directory; ``head`` goes first in the YAML, ``ds`` replaces the JSON."""
    procutil.install_sim_model(MODEL, model_dir)
    (model_dir / "ds_config.json").write_text(ds if ds is not None else json.dumps(DS))
    body = yaml.safe_dump({"entrypoint": "python3 model.py", "resources": {"slots_per_trial": 1},
                           "searcher": {"max_length": 10},
                           "hyperparameters": {"deepspeed_config": "ds_config.json"}})
    path = model_dir / "deepspeed.yaml"
    path.write_text(head + (f"name: {name}\n" if name else "") + body)
    return path


def _tree(root: Path) -> list[str]:
    return sorted(str(q.relative_to(root)) for q in root.rglob("*"))


# ------------------------------------------------------------------ acceptance: the real CLI
def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP_BYTES, CAP_BYTES))


def test_hostile_files_make_the_dsat_cli_exit_2_fast_under_a_3gb_cap(tmp_path):
    cases = {}
    bomb = tmp_path / "bomb"
    bomb.mkdir()
    experiment(bomb, head=alias_bomb(), name="*l8")
    cases["bomb"] = (bomb, ["deepspeed.yaml", "aliases", "expand to more than"])
    inf = tmp_path / "inf"
    inf.mkdir()
    experiment(inf, ds=json.dumps(DS).replace("0.001", "1e999"))
    cases["inf"] = (inf, ["ds_config.json", "1e999 is not a finite number"])
    latin = tmp_path / "latin"
    latin.mkdir()
    path = experiment(latin)
    path.write_bytes(path.read_bytes().replace(b"name: sim", b"name: caf\xe9"))
    cases["latin"] = (latin, ["deepspeed.yaml", "not UTF-8", "0xe9", "offset"])
    before = {k: _tree(d) for k, (d, _) in cases.items()}
    started = time.monotonic()
    procs = {k: subprocess.Popen([sys.executable, "-m", "toolkit.dsat", "binary", "deepspeed.yaml", "."],
                                 cwd=d, env=procutil.child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, preexec_fn=_capped)
             for k, (d, _) in cases.items()}
    outs = {k: proc.communicate(timeout=60)[0] for k, proc in procs.items()}
    assert time.monotonic() - started < 60
    for key, (directory, fragments) in cases.items():
        out = outs[key]
        assert procs[key].returncode == 2, f"{key}: exit {procs[key].returncode}\n{out[-3000:]}"
        assert "Traceback" not in out and "MemoryError" not in out, out[-3000:]
        for fragment in fragments:
            assert fragment in out, f"{key}: {fragment!r} missing from:\n{out[-3000:]}"
        assert _tree(directory) == before[key], f"{key} created files"
        assert not (directory / "dsat_output").exists()


# ------------------------------------------------------------------ the loader
def test_an_alias_bomb_is_refused_wherever_it_is_used(tmp_path):
    for where in ("name: *l8\n", "hyperparameters: {big: *l8}\n",
                  "hyperparameters: {overwrite_deepspeed_args: {x: *l8}}\n"):
        path = tmp_path / "exp.yaml"
        path.write_text(alias_bomb() + where)
        started = time.monotonic()
        with pytest.raises(ConfigError, match="expand to more than") as caught:
            toolkit.load_experiment_config(path)
        assert time.monotonic() - started < 5 and str(path) in str(caught.value)


def test_aliases_within_the_budget_still_work():
    assert parse_yaml(alias_bomb(levels=3, width=10) + "x: *l2\n", source="t")["x"][0][0] == ["x"] * 10
    merged = parse_yaml("base: &b {lr: 1, wd: 2}\ntrial:\n  <<: *b\n  lr: 3\n", source="t")
    assert merged["trial"] == {"lr": 3, "wd": 2}


@pytest.mark.parametrize("text, fragment", [
    ("a: &a [*a]\n", "recursive alias"),
    ("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", f"deeper than {MAX_DEPTH}"),
    ("".join("  " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 2)), f"deeper than {MAX_DEPTH}"),
    ("b0: &b0 [[[[[[[[[[1]]]]]]]]]]\n" + "".join(f"b{i}: &b{i} [[[[[[[[[[*b{i - 1}]]]]]]]]]]\n"
                                                for i in range(1, 11)), f"nest deeper than {MAX_DEPTH}"),
    ("lr: .nan\n", "'.nan' is not a finite number"),
    ("lr: -.inf\n", "'-.inf' is not a finite number"),
    ("lr: 1.0e+999\n", "'1.0e+999' is not a finite number"),
    ("entrypoint: a\nname: x\nentrypoint: b\n", "duplicate key 'entrypoint' (lines 1 and 3)"),
    ("a: {x: 1, x: 2}\n", "duplicate key 'x'"),
    ("a: !!binary aGVsbG8=\n", "not allowed"),
    ("a: !!set {x}\n", "not allowed"),
    ("a: !!python/object/apply:os.system [touch pwned]\n", "python/object/apply"),
    ("a: " + "9" * 5000 + "\n", "a number Python cannot read"),
    # aliases of one small scalar: no expansion, but more uses than any config has
    ("a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n",
     f"more than {MAX_ALIASES} aliases (*name): refused"),
    # unhashable keys: the duplicate-key check leaves them to yaml's own message
    ("? [1, 2]\n: x\n", "at line 1, column 3: found unhashable key"),
    ("{[1, 2]: x, [1, 2]: y}\n", "found unhashable key"),
])
def test_yaml_bounds(text, fragment):
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        parse_yaml(text, source="exp.yaml")
    assert fragment in str(caught.value) and "exp.yaml" in str(caught.value)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("text, fragment", [
    ('{"lr": 1e999}', "1e999 is not a finite number"),
    ('{"lr": -1e999}', "-1e999 is not a finite number"),
    ('{"lr": NaN}', "NaN is not valid JSON"),
    ('{"lr": -Infinity}', "-Infinity is not valid JSON"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1), f"deeper than {MAX_DEPTH}"),
    ("[" * 100_000 + "]" * 100_000, f"deeper than {MAX_DEPTH}"),
    ('{"a": ' + "9" * 5000 + "}", "4300 digits"),
])
def test_json_bounds(text, fragment):
    with pytest.raises(ConfigError) as caught:
        parse_json(text, source="ds_config.json", expect_object=False)
    assert fragment in str(caught.value) and "ds_config.json" in str(caught.value)


def test_files_are_capped_and_must_be_utf8(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(ConfigError, match=r"over the limit of 1,000 bytes") as caught:
        load_json(big, max_bytes=1000, what="DeepSpeed config")
    assert str(big) in str(caught.value) and "DeepSpeed config is 2,009 bytes" in str(caught.value)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: ok\ndescription: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"byte 0xe9 at offset 25 \(line 2\)"):
        load_yaml(latin)
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfname: ok\n")
    assert load_yaml(bom) == {"name": "ok"}


def test_yaml_gives_only_json_types():
    assert parse_yaml("day: 2024-01-02\nwhen: 2024-01-02 10:00:00\n", source="t") == {
        "day": "2024-01-02", "when": "2024-01-02 10:00:00"}


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Cc")),
              max_size=12),
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=6), children, max_size=4)),
    max_leaves=20)


@settings(max_examples=60, deadline=None)
@given(_plain)
def test_every_finite_json_value_round_trips_through_both_loaders(value):
    assert parse_json(json.dumps(value), source="t", expect_object=False) == value
    assert parse_yaml(yaml.safe_dump(value), source="t") == value


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_a_value_or_a_config_error(text):
    for parse in (parse_yaml, parse_json):
        try:
            parse(text, source="fuzz")
        except ConfigError:
            pass


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(2, 12))
@example(5, 11).via("194,876 values: the largest accepted near the bound")
@example(5, 12).via("296,135 values: refused")
def test_alias_expansion_is_counted_exactly(levels, width):
    sizes = [sum(width ** i for i in range(k + 2)) for k in range(levels)]  # list l_k, expanded
    total = 1 + levels + sum(sizes)  # the top mapping, its keys, its values
    started = time.monotonic()
    try:
        parse_yaml(alias_bomb(levels, width), source="t")
        accepted = True
    except ConfigError as err:
        assert f"expand to more than {MAX_YAML_NODES:,}" in str(err)
        accepted = False
    assert time.monotonic() - started < 5
    assert accepted == (total <= MAX_YAML_NODES), (levels, width, total)


# ------------------------------------------------------------------ the entrypoint
def test_an_unbalanced_quote_in_the_entrypoint_is_a_config_error_for_both_clis(tmp_path, capsys):
    path = experiment(tmp_path)
    path.write_text(path.read_text().replace("entrypoint: python3 model.py",
                                             "entrypoint: python3 model.py '--x"))
    with pytest.raises(ConfigError, match="No closing quotation"):
        toolkit.load_experiment_config(path)
    assert dsat_main(["binary", str(path), str(tmp_path), "--memory-per-slot", "100MiB"]) == 2
    assert run_main([str(path), str(tmp_path), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("No closing quotation") == 2 and "Traceback" not in err
    assert not (tmp_path / "dsat_output").exists() and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ dsat's records and --resume
def _result_event(trial_id: int, *, profile: dict | None = None, error: str | None = None) -> dict:
    spec = TrialSpec(trial_id, 1, {"stage": 1}, profile=trial_id == 0)
    status = TrialStatus.OK if error is None else TrialStatus.FAILED
    metrics = dict.fromkeys(METRICS, 1.0) if error is None else {}
    result = TrialResult(spec, status, metrics, 1.0, error, profile)
    return {"event": "result", "trial_id": trial_id, "result": result.to_json()}


PROFILE = {"num_params": 10, "trainable_params": 10, "activation_bytes_per_example": 4,
           "memory_per_slot": 2**30, "micro_batch": 1, "peak_bytes": 2**20, "device": "cpu"}


def _write_log(path: Path, events: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)


def test_a_damaged_event_log_names_the_line_and_the_repair(tmp_path):
    log = tmp_path / "events.jsonl"
    start = {"event": "start", "trial_id": 0, "observed_before": 0,
             "spec": TrialSpec(0, 1, {"stage": 1}, profile=True).to_json()}
    lots = _result_event(0, profile={**PROFILE, "peak_bytes": "lots"})
    for bad, fragment in [(lots, "peak_bytes='lots'"),
                          ({"event": "result", "trial_id": "x"}, "trial_id='x'"),
                          ({"event": "start", "trial_id": 1, "observed_before": 0, "spec": {}},
                           "incomplete")]:
        _write_log(log, [start, bad, start])
        with pytest.raises(ConfigError) as caught:
            EventLog(log).read()
        message = str(caught.value)
        assert str(log) in message and "line 2" in message and fragment in message
        assert f"head -n 1 {log}" in message and "another --output-dir" in message
    log.write_bytes(json.dumps(start).encode() + b"\n\xff\xfe\n" + json.dumps(start).encode() + b"\n")
    with pytest.raises(ConfigError, match="line 2: not UTF-8"):
        EventLog(log).read()


def test_a_torn_last_line_is_ignored_and_dropped_by_the_next_append(tmp_path):
    log = tmp_path / "events.jsonl"
    _write_log(log, [_result_event(0, profile=PROFILE)], tail='{"event": "res')
    records = EventLog(log)
    assert len(records.read()) == 1
    records.append(_result_event(1))
    assert [e["trial_id"] for e in EventLog(log).read()] == [0, 1]


def test_an_old_long_error_is_cut_when_read(tmp_path):
    log = tmp_path / "events.jsonl"
    _write_log(log, [_result_event(1, error="E" * 100_000)])
    error = EventLog(log).read()[0]["result"]["error"]
    assert len(error) < MAX_ERROR_CHARS + 200 and "characters cut" in error


def _args(model_dir: Path, out: Path, *extra: str):
    from toolkit.dsat.tuner_cli import build_parser
    return build_parser().parse_args(["binary", str(model_dir / "deepspeed.yaml"), str(model_dir),
                                      "--output-dir", str(out), "--memory-per-slot", "100MiB", *extra])


def test_resume_refuses_a_damaged_log_and_works_after_the_named_repair(tmp_path, capsys):
    from toolkit.dsat.tuner_cli import make_plan
    experiment(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    log = out / "events.jsonl"
    good = {"event": "start", "trial_id": 0, "observed_before": 0,
            "spec": TrialSpec(0, 1, {"stage": 1}, profile=True).to_json()}
    _write_log(log, [good, _result_event(0, profile={**PROFILE, "peak_bytes": "lots"})])
    (out / "profile.json").write_text('{"profile": {"peak_bytes": "lots"')  # rewritten by the profiling phase
    before = {q: q.read_bytes() for q in out.iterdir()}
    argv = ["binary", str(tmp_path / "deepspeed.yaml"), str(tmp_path), "--output-dir", str(out),
            "--memory-per-slot", "100MiB", "--resume"]
    assert dsat_main(argv) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "peak_bytes='lots'" in err and "head -n 1" in err and "Traceback" not in err
    assert {q: q.read_bytes() for q in out.iterdir()} == before
    log.write_text(log.read_text().splitlines()[0] + "\n")  # what the message says to do
    assert make_plan(_args(tmp_path, out, "--resume")).resume
    (out / "dsat_search.json").write_text("{")
    with pytest.raises(ConfigError, match="dsat_search.json.*malformed JSON.*delete it"):
        make_plan(_args(tmp_path, out, "--resume"))


def test_a_profile_with_a_bad_count_is_a_corrupt_result(tmp_path):
    spec = TrialSpec(0, 1, {"stage": 1}, profile=True)
    result = {"trial_id": 0, "status": "ok", "metrics": dict.fromkeys(METRICS, 1.0),
              "profile": {**PROFILE, "peak_bytes": "lots"}}
    (tmp_path / "result.json").write_text(json.dumps(result))
    verdict = classify(spec, directory=tmp_path, code=0, duration_s=1.0)
    assert verdict.status is TrialStatus.FAILED and "peak_bytes='lots'" in verdict.error
    (tmp_path / "result.json").write_text(json.dumps(result).replace('"lots"', "1e999"))
    verdict = classify(spec, directory=tmp_path, code=0, duration_s=1.0)
    assert verdict.status is TrialStatus.FAILED and "1e999 is not a finite number" in verdict.error


def test_a_huge_error_from_a_trial_is_cut_where_it_is_read(tmp_path):
    spec = TrialSpec(3, 1, {"stage": 1})
    huge = {"trial_id": 3, "status": "oom", "error": "x" * 5_000_000}
    (tmp_path / "result.json").write_text(json.dumps(huge))
    verdict = classify(spec, directory=tmp_path, code=75, duration_s=1.0)
    assert verdict.status is TrialStatus.OOM
    assert len(verdict.error) < MAX_ERROR_CHARS + 300 and str(tmp_path / "result.json") in verdict.error


def test_a_damaged_profile_json_is_rewritten_with_the_boundaries(tmp_path):
    said = []

    class Phase:
        out = tmp_path
        say = staticmethod(said.append)

    (tmp_path / "profile.json").write_text('{"prediction": ')
    ProfilingPhase._record_boundaries(Phase(), [])
    assert "damaged" in said[0] and json.loads((tmp_path / "profile.json").read_text()) == {"found": {}}


# ------------------------------------------------------------------ the Determined layer's records
def test_a_damaged_trial_record_is_a_clear_error_for_toolkit_run(tmp_path, capsys):
    path = experiment(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / TRIAL_FILE).write_text('{"trial_id": "seven", "experiment_id": 1}')
    with pytest.raises(ConfigError, match="trial_id='seven'.*delete it"):
        load_trial_state(run_dir, write=False)
    before = sorted(os.listdir(run_dir))
    assert run_main([str(path), str(tmp_path), "--output-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert TRIAL_FILE in err and "seven" in err and "Traceback" not in err
    assert sorted(os.listdir(run_dir)) == before


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_config_dict_with_a_non_finite_number_is_refused(bad):
    """A config built in code never went through the loader; validation refuses it there too."""
    from toolkit.config.validate import validate_ds_config

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, bad]}}}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betas\[1\]=.*expected a finite number"):
        validate_ds_config(config, device="cpu", data_parallel_size=1)
