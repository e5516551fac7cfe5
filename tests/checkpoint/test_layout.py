"""The checkpoint directory's layout and commit protocol (toolkit.checkpoint.layout): which checkpoint a
load takes, whether a save may write and what it cleans first, what keep_last deletes, which layouts
DeepSpeed cannot load across, and the file effects (scan, latest, discard) on a real directory. No
DeepSpeed, no process: the decisions are pure, the effects are checked on files."""

import json
import os

import pytest

from toolkit.checkpoint import layout
from toolkit.checkpoint.layout import COMMIT_FILE, LATEST_FILE, RUN_FILE, STARTED_FILE, DirState, TagInfo
from toolkit.errors import CheckpointError, ConfigError


def _committed(tag, seq, **meta):
    return TagInfo(tag=tag, entries=(COMMIT_FILE, "mp_rank_00_model_states.pt"),
                   metadata={"tag": tag, "seq": seq, **meta})


def _state(*tags, latest=None, run_id="run-a", latest_problem=None):
    return DirState(root="/ckpt", run={"run_id": run_id} if run_id else None, latest=latest,
                    tags={t.tag: t for t in tags}, latest_problem=latest_problem)


def test_a_load_follows_latest_else_the_newest_committed_with_a_warning():
    old, new = _committed("step2", 0), _committed("step4", 1)
    partial = TagInfo(tag="step6", entries=(STARTED_FILE, "mp_rank_00_model_states.pt"))
    assert layout.resolve_tag(_state(old, new, partial, latest="step2"), None) == (old, None)  # a rollback
    chosen, warning = layout.resolve_tag(_state(old, new, partial, latest="step6"), None)
    assert chosen is new and "names 'step6', which is not committed" in warning
    assert "latest is missing" in layout.resolve_tag(_state(old, new), None)[1]
    assert layout.resolve_tag(_state(), None) == (None, None)
    assert layout.resolve_tag(_state(old, new), "step2") == (old, None)
    with pytest.raises(CheckpointError, match="'step6' in /ckpt has no toolkit_checkpoint.json: its save"):
        layout.resolve_tag(_state(old, partial), "step6")
    with pytest.raises(CheckpointError, match="tag 'nope' does not exist in /ckpt; committed checkpoints "
                                              "there: 'step2'"):
        layout.resolve_tag(_state(old), "nope")
    with pytest.raises(ConfigError):
        layout.resolve_tag(_state(old), "../etc")
    foreign = TagInfo(tag="global_step9", entries=("mp_rank_00_model_states.pt",))
    with pytest.raises(CheckpointError, match="not written by toolkit.save_checkpoint .*'global_step9'"):
        layout.resolve_tag(_state(foreign, run_id=None), None)


def test_a_save_into_another_runs_directory_needs_overwrite_and_cleans_what_it_replaces():
    old, new = _committed("step2", 0, steps_completed=2), _committed("step4", 1)
    theirs = _state(old, new, latest="step4", run_id="run-b")
    with pytest.raises(CheckpointError, match="holds checkpoints of run run-b .*pass overwrite=True"):
        layout.plan_save(theirs, tag="step6", mine="run-a", overwrite=False)
    taken = layout.plan_save(theirs, tag="step6", mine="run-a", overwrite=True)
    assert (taken.run_id, taken.write_run_file, taken.seq) == ("run-a", True, 2) and taken.warnings
    mine = layout.plan_save(_state(old, new, latest="step4"), tag="step4", mine="run-a", overwrite=False)
    assert (mine.write_run_file, mine.discard, mine.new_latest, mine.remove_latest) == (False, ("step4",),
                                                                                      "step2", False)
    assert "replacing the committed checkpoint 'step4'" in mine.notes[0]
    alone = layout.plan_save(_state(new, latest="step4"), tag="step4", mine="run-a", overwrite=False)
    assert alone.remove_latest and alone.new_latest is None
    fresh = layout.plan_save(_state(run_id=None), tag="step0", mine=None, overwrite=False)
    assert fresh.write_run_file and len(fresh.run_id) == 16 and fresh.seq == 0
    interrupted = TagInfo(tag="step6", entries=(STARTED_FILE,))
    plan = layout.plan_save(_state(interrupted), tag="step6", mine="run-a", overwrite=False)
    assert plan.discard == ("step6",)
    other = TagInfo(tag="notes", entries=("readme.txt",))
    with pytest.raises(CheckpointError, match="it holds other files\\); choose another tag$"):
        layout.plan_save(_state(other), tag="notes", mine="run-a", overwrite=True)


def test_keep_last_deletes_the_oldest_committed_and_interrupted_saves_never_the_new_one():
    tags = [_committed(f"step{i}", i) for i in range(4)]
    leftover = TagInfo(tag="stepX", entries=(STARTED_FILE,))
    state = _state(*tags, leftover)
    assert layout.plan_keep_last(state, keep_last=2, just_written="step3") == ["step0", "step1", "stepX"]
    assert layout.plan_keep_last(state, keep_last=1, just_written="step1") == ["step0", "step2", "step3",
                                                                             "stepX"]


def test_layout_changes_deepspeed_cannot_load_across_are_named():
    saved = {"data_parallel_size": 2, "zero_stage": 3, "world_size": 2, "pipeline": False}
    assert layout.compatibility_problems(saved, dict(saved)) == []
    assert layout.compatibility_problems(saved, dict(saved, zero_stage=2, world_size=4)) == [
        "ZeRO stage: saved 3, this engine 2", "world size: saved 2, now 4"]
    assert "ds_to_universal --input_folder /ckpt/step4" in layout.universal_fix("/ckpt", "step4")


def test_the_directory_is_read_and_changed_only_through_toolkits_markers(tmp_path):
    root = tmp_path / "ckpt"
    assert layout.scan_dir(root).tags == {}
    for tag, seq in (("step2", 0), ("step4", 1)):
        (root / tag).mkdir(parents=True)
        (root / tag / COMMIT_FILE).write_text(json.dumps({"tag": tag, "seq": seq, "steps_completed": seq}))
    (root / RUN_FILE).write_text(json.dumps({"run_id": "run-a"}))
    (root / "elsewhere").mkdir()
    os.symlink(root / "elsewhere", root / "linked")  # a link is never a checkpoint of toolkit's
    layout.set_latest(root, "step4")
    state = layout.scan_dir(root)
    assert [t.tag for t in state.committed()] == ["step2", "step4"] and "linked" not in state.tags
    assert (state.latest, state.run_id) == ("step4", "run-a")
    layout.set_latest(root, None)
    assert not (root / LATEST_FILE).exists()
    layout.discard_tag(root, "step2")
    with pytest.raises(CheckpointError, match="never through a link"):
        layout.discard_tag(root, "linked")  # not a real directory: left alone
    assert sorted(p.name for p in root.iterdir()) == ["elsewhere", "linked", "step4", RUN_FILE]
    (root / f"{layout.TRASH_PREFIX}step0-1234").mkdir()  # an interrupted discard's leftover
    layout.empty_trash(root)
    assert not any(p.name.startswith(layout.TRASH_PREFIX) for p in root.iterdir())
    (root / "step4" / COMMIT_FILE).write_text(json.dumps({"tag": "other", "seq": 1}))
    with pytest.raises(CheckpointError, match="its tag='other' is not the name of its directory 'step4'"):
        layout.scan_dir(root)
    assert layout.checkpoint_root(root) == str(root)
    with pytest.raises(ConfigError, match="only save_checkpoint and load_checkpoint take s3://"):
        layout.checkpoint_root("s3://bucket/x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        layout.checkpoint_root(root / RUN_FILE)
    with pytest.raises(CheckpointError):
        layout.tag_path(root, "linked", to_write=True)
