"""toolkit.checkpoint.api, toolkit.checkpoint.layout and toolkit.checkpoint.rng.

Decisions (tags, ownership, keep_last, compatibility) are tested as pure functions; the rest with
2 real ranks under torchrun and real DeepSpeed engines on CPU (gloo): round trips for ZeRO 0-3
and a 2-stage pipeline, load errors raised before DeepSpeed reads anything, consolidation, a
universal-checkpoint load at another world size, and ranks SIGKILLed at three points of a save.
The exact resume over a whole run is tests/checkpoint/test_exact_resume.py.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from helpers import procutil
from toolkit._files import atomic_write, atomic_write_json
from toolkit.checkpoint import api, layout
from toolkit.checkpoint.api import consolidate_checkpoint, load_checkpoint, save_checkpoint
from toolkit.checkpoint.rng import capture_rng_state, restore_rng_state
from toolkit.errors import CheckpointError, ConfigError

ROUNDTRIP = procutil.WORKERS / "ckpt_roundtrip.py"
SINGLE = procutil.WORKERS / "ckpt_single.py"
KILL = procutil.WORKERS / "ckpt_kill.py"
CASES = ("zero0", "zero1", "zero2", "zero3", "pipe")
KILL_MODES = ("ds_write", "before_commit", "before_latest")


# ----------------------------------------------------------------------------- pure decisions

def _tag(name, *, committed=False, started=True, seq=0, files=("mp_rank_00_model_states.pt",), **meta):
    entries = tuple(files) + ((layout.STARTED_FILE,) if started else ()) + \
        ((layout.COMMIT_FILE,) if committed else ())
    metadata = ({"tag": name, "seq": seq, "steps_completed": seq, "world_size": 2, **meta} if committed
                else None)
    return layout.TagInfo(tag=name, entries=entries, metadata=metadata)


def _state(*tags, run_id="run-a", latest=None):
    return layout.DirState(root="/ckpt", run=None if run_id is None else {"run_id": run_id},
                           latest=latest, tags={t.tag: t for t in tags})


@pytest.mark.parametrize("bad", ["../x", "..", ".", "a/b", "/abs", ".hidden", "", "a b", "x" * 201, "a\\b",
                                 "latest", "toolkit_run", "zero_to_fp32.py", None, 5, b"step"])
def test_validate_name_rejects_unsafe_names(bad):
    with pytest.raises(CheckpointError, match="expected|choose another"):
        layout.validate_name(bad)


def test_validate_name_accepts_plain_names():
    for good in ("step_100", "v1.2-final", "A", "0"):
        assert layout.validate_name(good) == good


def test_resolve_follows_latest_even_when_older():
    state = _state(_tag("step_1", committed=True, seq=0), _tag("step_2", committed=True, seq=1),
                   latest="step_1")
    assert layout.resolve_tag(state, None) == (state.tags["step_1"], None)


def test_resolve_falls_back_to_newest_committed_and_says_so():
    state = _state(_tag("step_1", committed=True, seq=0), _tag("step_2", committed=True, seq=1),
                   _tag("step_3"), latest="step_3")
    info, warning = layout.resolve_tag(state, None)
    assert info.tag == "step_2" and "'step_3', which is not committed" in warning
    info, warning = layout.resolve_tag(_state(*state.tags.values(), latest=None), None)
    assert info.tag == "step_2" and "missing" in warning


def test_resolve_never_picks_an_uncommitted_tag():
    state = _state(_tag("step_1", committed=True), _tag("step_2"))
    with pytest.raises(CheckpointError, match="interrupted"):
        layout.resolve_tag(state, "step_2")
    with pytest.raises(CheckpointError, match="does not exist.*'step_1'"):
        layout.resolve_tag(state, "step_9")
    assert layout.resolve_tag(_state(_tag("step_2")), None) == (None, None)
    assert layout.resolve_tag(_state(run_id=None), None) == (None, None)


def test_resolve_refuses_plain_deepspeed_checkpoints():
    with pytest.raises(CheckpointError, match="not written by toolkit.save_checkpoint"):
        layout.resolve_tag(_state(_tag("global_step5", started=False), run_id=None, latest="global_step5"),
                           None)


def test_plan_save_new_directory_and_own_run():
    plan = layout.plan_save(_state(run_id=None), tag="step_1", mine=None, overwrite=False)
    assert plan.write_run_file and plan.run_id and plan.seq == 0 and not plan.discard
    own = _state(_tag("step_1", committed=True, seq=4))
    plan = layout.plan_save(own, tag="step_2", mine="run-a", overwrite=False)
    assert (plan.run_id, plan.write_run_file, plan.seq) == ("run-a", False, 5)


@pytest.mark.parametrize("mine", [None, "run-b"])
def test_plan_save_refuses_another_runs_directory(mine):
    state = _state(_tag("step_1", committed=True))
    with pytest.raises(CheckpointError, match="run run-a.*load_checkpoint.*overwrite=True"):
        layout.plan_save(state, tag="step_2", mine=mine, overwrite=False)
    plan = layout.plan_save(state, tag="step_2", mine=mine, overwrite=True)
    assert plan.write_run_file and plan.run_id != "run-a" and plan.warnings


def test_plan_save_refuses_unmarked_deepspeed_checkpoints():
    state = _state(_tag("global_step5", started=False), run_id=None)
    with pytest.raises(CheckpointError, match="another run"):
        layout.plan_save(state, tag="step_1", mine=None, overwrite=False)


def test_plan_save_continues_a_directory_without_committed_checkpoints():
    plan = layout.plan_save(_state(_tag("step_1")), tag="step_1", mine=None, overwrite=False)
    assert plan.run_id == "run-a" and not plan.write_run_file and plan.discard == ("step_1",)


def test_plan_save_replacing_the_latest_repoints_latest_first():
    state = _state(_tag("step_1", committed=True, seq=0), _tag("step_2", committed=True, seq=1),
                   latest="step_2")
    plan = layout.plan_save(state, tag="step_2", mine="run-a", overwrite=False)
    assert plan.discard == ("step_2",) and plan.new_latest == "step_1" and plan.seq == 2
    assert plan.notes and not plan.warnings  # this run's own tag: routine, not a warning
    only = _state(_tag("step_2", committed=True), latest="step_2")
    plan = layout.plan_save(only, tag="step_2", mine="run-a", overwrite=False)
    assert plan.remove_latest and plan.new_latest is None


def test_plan_save_protects_tag_directories_it_does_not_own():
    foreign = _state(_tag("step_1", started=False))
    with pytest.raises(CheckpointError, match="not written by toolkit.*overwrite=True"):
        layout.plan_save(foreign, tag="step_1", mine="run-a", overwrite=False)
    assert layout.plan_save(foreign, tag="step_1", mine="run-a", overwrite=True).discard == ("step_1",)
    user_dir = _state(_tag("step_1", started=False, files=("notes.txt",)))
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match="other files"):
            layout.plan_save(user_dir, tag="step_1", mine="run-a", overwrite=overwrite)
    empty = _state(_tag("step_1", started=False, files=()))
    assert layout.plan_save(empty, tag="step_1", mine="run-a", overwrite=False).discard == ()


def test_plan_keep_last_keeps_the_new_one_and_drops_leftovers():
    state = _state(*[_tag(f"s{i}", committed=True, seq=i) for i in range(4)], _tag("crashed"),
                   _tag("foreign", started=False))
    assert layout.plan_keep_last(state, keep_last=2, just_written="s3") == ["s0", "s1", "crashed"]
    assert layout.plan_keep_last(state, keep_last=1, just_written="s3") == ["s0", "s1", "s2", "crashed"]
    assert layout.plan_keep_last(state, keep_last=9, just_written="s3") == ["crashed"]
    # The new one stays even when an older tag has a higher sequence number.
    assert "s1" not in layout.plan_keep_last(state, keep_last=1, just_written="s1")


def test_compatibility_problems_name_each_difference():
    saved = {"world_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 1, "pipeline": False,
             "pipeline_stages": None, "zero_stage": 1}
    assert layout.compatibility_problems(saved, dict(saved)) == []
    problems = layout.compatibility_problems(saved, {**saved, "world_size": 1, "data_parallel_size": 1,
                                                     "zero_stage": 3})
    assert problems == ["data-parallel size: saved 2, this engine 1", "ZeRO stage: saved 1, this engine 3",
                        "world size: saved 2, now 1"]
    assert "ds_to_universal" in layout.universal_fix("/ckpt", "step_2")


# ------------------------------------------------------------------------ files, one process

def test_scan_dir_reads_the_markers(tmp_path):
    assert layout.scan_dir(tmp_path / "missing").tags == {}
    (tmp_path / "step_1").mkdir()
    atomic_write_json(tmp_path / "step_1" / layout.STARTED_FILE, {})
    atomic_write_json(tmp_path / "step_1" / layout.COMMIT_FILE, {"seq": 3, "tag": "step_1"})
    (tmp_path / "step_2").mkdir()
    atomic_write_json(tmp_path / "step_2" / layout.STARTED_FILE, {})
    (tmp_path / f"{layout.TRASH_PREFIX}old").mkdir()
    atomic_write_json(tmp_path / layout.RUN_FILE, {"run_id": "abc"})
    layout.set_latest(tmp_path, "step_1")
    state = layout.scan_dir(tmp_path)
    assert state.run_id == "abc" and state.latest == "step_1" and sorted(state.tags) == ["step_1", "step_2"]
    assert state.tags["step_1"].committed and state.tags["step_1"].seq == 3
    assert state.tags["step_2"].started and not state.tags["step_2"].committed
    layout.empty_trash(tmp_path)
    assert not (tmp_path / f"{layout.TRASH_PREFIX}old").exists()
    layout.discard_tag(tmp_path, "step_2")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_1", layout.RUN_FILE]
    layout.set_latest(tmp_path, None)
    assert layout.scan_dir(tmp_path).latest is None


def test_damaged_metadata_is_an_error_not_a_checkpoint(tmp_path):
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / layout.COMMIT_FILE).write_text("{trunc")
    with pytest.raises(CheckpointError, match="damaged"):
        layout.scan_dir(tmp_path)


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "latest"
    atomic_write(target, b"step_1")

    def failing(fh):
        fh.write(b"step_")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, failing)
    assert target.read_bytes() == b"step_1" and os.listdir(tmp_path) == ["latest"]


def test_rng_round_trip_through_a_weights_only_load(tmp_path):
    random.gauss(0, 1)
    np.random.normal()  # leaves a cached Gaussian in both generators: part of the state
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    first = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(3))
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(3))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state({"version": 99})


def test_arguments_are_checked_before_any_collective(tmp_path):
    # No process group in this process: each error must come before get_context().
    engine = object()
    for kwargs, match in [({"steps_completed": -1}, "steps_completed=-1: expected an integer >= 0"),
                          ({"steps_completed": True}, "steps_completed=True"),
                          ({"steps_completed": 1, "keep_last": 0}, "keep_last=0: expected an integer >= 1"),
                          ({"steps_completed": 1, "client_state": [1]},
                           r"client_state=\[1\] \(list\): expected a dict"),
                          ({"steps_completed": 1, "tag": "../x"}, "tag='../x': expected"),
                          ({"steps_completed": 1, "run_id": "a/b"}, "run_id='a/b': expected"),
                          ({"steps_completed": 1, "overwrite": "yes"},
                           "overwrite='yes': expected True or False")]:
        with pytest.raises(ConfigError, match=match):
            save_checkpoint(engine, tmp_path, **kwargs)
    with pytest.raises(TypeError, match="deepspeed.initialize"):
        save_checkpoint(engine, tmp_path, steps_completed=1)
    with pytest.raises(ConfigError, match="tag='..'"):
        load_checkpoint(engine, tmp_path, tag="..")
    with pytest.raises(ConfigError, match=r"load_checkpoint\(\).*read_only='yes': expected True or False"):
        load_checkpoint(engine, tmp_path, read_only="yes")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(engine, tmp_path / "file")
    with pytest.raises(ConfigError, match="checkpoint_dir=''"):
        save_checkpoint(engine, "", steps_completed=1)
    assert not (tmp_path / "x").exists()


def test_every_bad_argument_of_a_save_is_listed_in_one_error(tmp_path):
    with pytest.raises(ConfigError) as caught:
        save_checkpoint(object(), tmp_path, steps_completed=-1, keep_last=0, client_state=5, tag="../x",
                        run_id="a/b", overwrite=1)
    assert len(caught.value.problems) == 6, caught.value.problems
    for fragment in ("steps_completed=-1", "keep_last=0", "client_state=5 (int)", "tag='../x'",
                     "run_id='a/b'", "overwrite=1"):
        assert fragment in str(caught.value)
    assert not isinstance(caught.value, CheckpointError)


def test_a_numpy_integer_step_is_stored_as_a_plain_int(tmp_path):
    # is_int accepts NumPy integers; the save must still name the tag and write JSON with a plain int.
    with pytest.raises(TypeError, match="deepspeed.initialize"):  # arguments pass, the engine does not
        save_checkpoint(object(), tmp_path, steps_completed=np.int64(7), keep_last=np.int32(2))


def test_consolidate_needs_a_committed_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        consolidate_checkpoint(tmp_path, tmp_path / "out.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        consolidate_checkpoint(tmp_path, tmp_path)
    with pytest.raises(ConfigError) as caught:
        consolidate_checkpoint(tmp_path, "", tag="../x")
    assert [p.split(":")[0] for p in caught.value.problems] == ["tag='../x'", "output_path=''"]


def test_consolidate_refuses_a_tensor_parallel_checkpoint_it_falls_back_to(tmp_path, caplog):
    (tmp_path / "step_1").mkdir()
    atomic_write_json(tmp_path / "step_1" / layout.STARTED_FILE, {})
    atomic_write_json(tmp_path / "step_1" / layout.COMMIT_FILE, {"seq": 0, "tag": "step_1",
                                                                 "tensor_parallel_size": 2})
    (tmp_path / "step_2").mkdir()
    atomic_write_json(tmp_path / "step_2" / layout.STARTED_FILE, {})  # interrupted: latest names it
    layout.set_latest(tmp_path, "step_2")
    with pytest.raises(CheckpointError, match=r"checkpoint 'step_1' is tensor parallel \(size 2\)"):
        consolidate_checkpoint(tmp_path, tmp_path / "out.pt")
    assert "step_2" in caplog.text and "not committed" in caplog.text
    assert not (tmp_path / "out.pt").exists()


def test_a_load_refuses_files_deepspeed_or_toolkit_did_not_write():
    # What load_checkpoint makes of DeepSpeed's answer, once DeepSpeed has read the tag directory.
    with pytest.raises(CheckpointError, match=r"DeepSpeed found no model states in /ckpt/step_1"):
        api._our_state(None, None, "/ckpt", "step_1")
    with pytest.raises(CheckpointError,
                       match=r"/ckpt/step_1 lacks toolkit's client state .*engine.load_checkpoint"):
        api._our_state("/ckpt/step_1", {"module": {}}, "/ckpt", "step_1")


# ------------------------------------------------------------------- 2 real ranks, DeepSpeed

def _read(path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory, killed_runs):
    """Run the 2-rank round-trip worker (which first resumes the runs killed inside a save: its
    launch is their new process), then the 1-rank worker (which first converts zero1 to a
    universal checkpoint with DeepSpeed's ds_to_universal)."""
    out = tmp_path_factory.mktemp("roundtrip")
    killed_dirs = [str(killed_runs[0] / mode) for mode in KILL_MODES]
    procutil.check(procutil.run(procutil.torchrun_argv(ROUNDTRIP, str(out), *killed_dirs)))
    procutil.check(procutil.run([sys.executable, str(SINGLE), str(out)]))
    return out, [_read(out / f"rank{r}.json") for r in range(2)], _read(out / "single.json")


@pytest.mark.parametrize("case", CASES)
def test_round_trip_resumes_identically(roundtrip, case):
    _, records, _ = roundtrip
    for rank, record in enumerate(records):
        got = record["cases"][case]
        assert got["tag"] == "step_2" and got["steps"] == 2, rank
        assert got["client_state"] == {"case": case, "t": [0, 1, 2]}
        assert got["init_differs"], "the loading engine must start from other weights"
        assert got["params_after_load"] and got["optim_after_load"] and got["optim_tensors"] > 0, (rank, got)
        # Same data (RNG restored), same dropout masks, same Adam moments: bitwise equal steps.
        assert got["losses_b"] == got["losses_a"] and got["params_after_steps"], (rank, got)


@pytest.mark.parametrize("name, match, kind", [
    ("zero_stage", "ZeRO stage: saved 1, this engine 2", "CheckpointError"),
    ("pipeline", "pipeline engine: saved True, this engine False", "CheckpointError"),
    ("not_pipeline", "pipeline engine: saved False, this engine True", "CheckpointError"),
    ("missing_tag", "'step_99' does not exist", "CheckpointError"),
    ("traversal_load", "tag='../zero0/step_2'", "ConfigError"),      # a bad argument
    ("traversal_save", "tag='../escaped'", "ConfigError"),
    ("other_run_id", "checkpoints of run run-a .*not of this run \\(run-b\\)", "CheckpointError"),
    ("fresh_process", "not of this process, which has not loaded from it", "CheckpointError"),
    ("rank_mismatch", "the chief saves 'step_5' at steps_completed=5; pass the same values on every rank",
     "CheckpointError"),
])
def test_errors_on_every_rank_before_deepspeed_loads(roundtrip, name, match, kind):
    _, records, _ = roundtrip
    for record in records:
        error = record["errors"][name]
        assert error["raised"] is not None and not error["deepspeed_touched"], error
        assert re.search(match, error["raised"]), error["raised"]
        assert error["type"] == kind, error
    assert not records[0]["escaped_exists"]


def test_run_ownership_resume_and_takeover(roundtrip):
    _, records, _ = roundtrip
    assert records[0]["own_resumed"] == 10  # after the load, the save into the directory worked
    assert json.loads(records[0]["own_run"])["run_id"] == "run-b"  # overwrite=True took it over


def test_keep_last(roundtrip):
    out, records, _ = roundtrip
    # .toolkit_lock: the run's writer lock (toolkit/checkpoint/lock.py), held while the run lives
    common = [".toolkit_lock", "foreign", "latest", "notes", "toolkit_run.json", "zero_to_fp32.py",
              "zero_to_torch.py"]
    assert records[0]["keep_listings"] == [sorted(common + ["step_1", "step_2"]),
                                           sorted(common + ["step_2", "step_3"]),
                                           sorted(common + ["step_2", "step_3"])]
    assert records[0]["keep_latest"] == "step_3" and records[0]["keep_seq"] == 3
    assert records[1]["keep_resumed"] == 3
    assert (out / "keep" / "notes" / "readme.txt").read_text() == "keep me"


@pytest.mark.parametrize("case", CASES)
def test_consolidate_gives_the_plain_model_its_weights(roundtrip, case):
    _, _, single = roundtrip
    got = single["consolidated"][case]
    assert got["tag"] == "step_2" and got["dtypes"] == ["torch.float32"] and got["equal"], got


def test_world_size_change_is_refused_and_the_universal_fix_works(roundtrip):
    _, _, single = roundtrip
    assert single["world_size"] == 1 and not single["deepspeed_touched"]
    error = single["world_size_error"]
    assert "data-parallel size: saved 2, this engine 1" in error
    assert "ds_to_universal" in error and '"load_universal": true' in error
    assert single["universal"] == {"steps": 2, "case": "zero1", "equal": True, "trains": True}


def _wait_for(paths, proc, log, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(path.exists() for path in paths):
            return
        if proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}) before pausing:\n"
                                 f"{log.read_text()[-6000:]}")
        time.sleep(0.2)
    raise AssertionError(f"worker did not pause within {timeout} s:\n{log.read_text()[-6000:]}")


def _kill_mid_save(out, mode):
    """Start the first run, SIGKILL both ranks while they are inside the second save."""
    log = out / "first.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(procutil.torchrun_argv(KILL, "first", str(out), mode),
                                env=procutil.child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pids = []
    try:
        _wait_for([out / f"paused_rank{r}" for r in range(2)], proc, log)
        pids = [int((out / f"pid_rank{r}").read_text()) for r in range(2)]
        snapshot = {"step_4": sorted(os.listdir(out / "ckpt" / "step_4")),
                    "latest": (out / "ckpt" / "latest").read_text()}
        for pid in pids:  # torchrun runs each rank in its own session: kill the ranks themselves
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0, log.read_text()[-4000:]
    return snapshot


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Per mode, a 2-rank run SIGKILLed inside its second save; the resume runs in the round-trip
    worker's launch (the ``roundtrip`` fixture)."""
    base = tmp_path_factory.mktemp("killed")
    snapshots, states = {}, {}
    for mode in KILL_MODES:
        (base / mode).mkdir()
        snapshots[mode] = _kill_mid_save(base / mode, mode)
        states[mode] = layout.resolve_tag(layout.scan_dir(base / mode / "ckpt"), None)[0].tag
    return base, snapshots, states


@pytest.fixture(scope="module")
def killed(killed_runs, roundtrip):
    return killed_runs


@pytest.mark.slow  # the fixture launches 3 two-rank jobs (the resume is in the round trip's launch)
@pytest.mark.parametrize("mode", KILL_MODES)
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(killed, mode):
    base, snapshots, states = killed
    snapshot = snapshots[mode]
    # Killed inside the save: step_4 was started; only in before_latest was it committed.
    assert layout.STARTED_FILE in snapshot["step_4"]
    assert any(name.endswith("_states.pt") for name in snapshot["step_4"]), snapshot  # DeepSpeed had written
    assert (layout.COMMIT_FILE in snapshot["step_4"]) == (mode == "before_latest"), snapshot
    assert snapshot["latest"] == "step_2" and states[mode] == "step_2"
    for rank in range(2):
        first = _read(base / mode / f"first_rank{rank}.json")
        resumed = _read(base / mode / f"resume_rank{rank}.json")
        assert "has not loaded from it" in resumed["save_before_load"]
        assert resumed["steps"] == 2 and resumed["client_state"] == {"phase": "first"}
        # The new run continues exactly: same losses and weights as the killed run's steps 3-4.
        assert resumed["losses"] == first["losses"] and resumed["params"] == first["params"], rank
        assert resumed["tag"] == "step_4" and resumed["latest"] == "step_4"
        assert "step_2" not in resumed["listing"] and "step_4" in resumed["listing"]
        hidden = [name for name in resumed["listing"] if name.startswith(".")]
        assert hidden == [".toolkit_lock"], resumed["listing"]  # no trash left; the live run's writer lock
