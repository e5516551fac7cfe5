"""Names that become paths cannot leave their directory: the one rule (toolkit/_names.py) where
checkpoint tags, run ids and Determined storage ids enter, fuzzed and probed with real files.

Every probe builds real directories in ``tmp_path`` (a victim directory outside the checkpoint
root, with a file in it) and checks after the call that nothing outside the root changed:

* Determined storage ids given to ``delete`` / ``restore_path`` / ``download`` / ``get_metadata``
  (``..``, absolute, empty, NUL, very long, a symlink out of the root, arbitrary text), and a
  ``pending`` or ``committed`` list forged in ``determined_checkpoints.json``, through the real
  ``det.core.init()``.
* A commit record whose ``tag`` points outside its directory, a damaged ``seq``, a symlinked tag
  directory, ``latest`` as a symlink to a secret file (never quoted), a FIFO as ``latest`` (no hang).
* One end-to-end probe with a real DeepSpeed engine (ZeRO-0, one process on CPU):
  ``load_checkpoint`` of a directory whose commit record names ``../A/step_3`` loads nothing,
  a symlinked tag directory is neither loaded nor written through, and a ``latest`` symlink's
  target is never printed.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import procutil, resets
from toolkit import _names
from toolkit.checkpoint import layout
from toolkit.compat import determined as det
from toolkit.compat.determined import storage
from toolkit.compat.determined.core.checkpoint import CheckpointContext
from toolkit.errors import CheckpointError, ConfigError

CATEGORY = "security"
SECRET = "TOP-SECRET-CONTENT-4711"
# The uuid4 is written out: xdist's workers must collect the same test ids.
GOOD_NAMES = ["global_step10", "step_3", "step_2_universal", "v1.2-final", "0",
              "63f04e84-67f4-48d6-95f1-edbdc6e71339"]
BAD_NAMES = ["", ".", "..", "../x", "../../somewhere", "/abs/path", "a/b", "a\\b", "a\0b", ".hidden",
             "x" * 201, "step\n1", " step", "step ", "-x", "~", "ä"]
# Text that mixes path syntax into names: dots, slashes, NUL, spaces, letters, non-ASCII.
NAMEISH = st.text(alphabet=st.sampled_from(list("./\\\0 _-aZ09~\nä")), max_size=12) | st.text(max_size=30)
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _victim(base: Path) -> Path:
    """A directory outside every root, with a file: it must survive every probe."""
    victim = base / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "keep.txt").write_text("keep")
    return victim


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (links as their targets), for before/after comparisons."""
    out = {}
    for entry in sorted(path.rglob("*")):
        rel = entry.relative_to(path).as_posix()
        out[rel] = (f"-> {os.readlink(entry)}" if entry.is_symlink() else
                    "<dir>" if entry.is_dir() else entry.read_text(errors="replace"))
    return out


# ------------------------------------------------------------------------------------- the rule

@pytest.mark.parametrize("name", GOOD_NAMES)
def test_legit_names_pass_the_rule(name, tmp_path):
    assert _names.check_name(name) == name
    assert _names.resolve_inside(tmp_path, name) == Path(os.path.realpath(tmp_path)) / name
    assert layout.name_problem(name) is None and storage.check_storage_id(name) == name


@pytest.mark.parametrize("name", BAD_NAMES + [None, 5, b"step"])
def test_unsafe_names_are_refused_with_the_callers_error(name, tmp_path):
    with pytest.raises(ConfigError, match="storage_id="):
        storage.check_storage_id(name)
    with pytest.raises(CheckpointError):
        _names.resolve_inside(tmp_path, name)
    with pytest.raises(CheckpointError):
        layout.tag_path(tmp_path, name)
    assert layout.name_problem(name)


def test_a_very_long_name_is_not_echoed_whole():
    with pytest.raises(ConfigError) as err:
        storage.check_storage_id("../" * 100_000)
    assert len(str(err.value)) < 1000


@SETTINGS
@given(name=NAMEISH)
def test_every_accepted_name_is_one_child_of_its_root(tmp_path, name):
    root = tmp_path / "root"
    try:
        resolved = _names.resolve_inside(root, name)
    except CheckpointError:
        assert _names.name_problem(name)
        return
    real_root = Path(os.path.realpath(root))
    assert resolved.parent == real_root and resolved.name == name
    assert "\0" not in name and not name.startswith(".") and 0 < len(name) <= _names.MAX_NAME


def test_a_symlink_out_of_the_root_is_refused_one_inside_is_followed(tmp_path):
    root, victim = tmp_path / "root", _victim(tmp_path)
    (root / "real").mkdir(parents=True)
    (root / "out").symlink_to(victim)
    (root / "in").symlink_to(root / "real")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("out", "dangling"):
        with pytest.raises(CheckpointError, match="symlink"):
            _names.resolve_inside(root, name)
    assert _names.resolve_inside(root, "in") == Path(os.path.realpath(root / "real"))
    with pytest.raises(CheckpointError, match="symlink"):
        _names.real_child(root, "in")  # written into or deleted: never through any link
    assert _names.real_child(root, "missing") is None and _names.real_child(root, "real") is not None


# ------------------------------------------------------------------ toolkit checkpoint directories

def _commit(root: Path, directory: str, **meta) -> Path:
    (root / directory).mkdir(parents=True, exist_ok=True)
    record = {"tag": directory, "seq": 0, "steps_completed": 3, "run_id": "run-a", **meta}
    path = root / directory / layout.COMMIT_FILE
    path.write_text(json.dumps(record))
    return path


def test_a_commit_record_whose_tag_points_outside_loads_nothing(tmp_path):
    _commit(tmp_path / "A", "step_3")                        # a real checkpoint of directory A
    path = _commit(tmp_path / "B", "x", tag="../A/step_3")   # B holds only a forged commit record
    with pytest.raises(CheckpointError) as err:
        layout.scan_dir(tmp_path / "B")
    assert str(path) in str(err.value) and "'../A/step_3'" in str(err.value)
    _commit(tmp_path / "C", "step_1", tag="step_2")          # names another tag of its own directory
    (tmp_path / "C" / "step_2").mkdir()
    with pytest.raises(CheckpointError, match="not the name of its directory"):
        layout.scan_dir(tmp_path / "C")


@SETTINGS
@given(tag=NAMEISH | st.none() | st.integers())
def test_no_commit_record_makes_another_directory_the_checkpoint(tmp_path, tag):
    root = tmp_path / "B"
    if not root.exists():
        _commit(tmp_path / "A", "step_3")
    _commit(root, "x", tag=tag)
    try:
        state = layout.scan_dir(root)
    except CheckpointError as err:
        assert tag != "x" and str(root / "x" / layout.COMMIT_FILE) in str(err)
        return
    assert tag == "x"
    info, _ = layout.resolve_tag(state, None)
    assert info.tag == "x" and layout.tag_path(root, info.tag).parent == Path(os.path.realpath(root))


@pytest.mark.parametrize("seq", ["x", None, -1, 1.5, True, [1], "3", {"a": 1}])
def test_a_damaged_seq_is_a_clear_error_naming_the_file(tmp_path, seq):
    path = _commit(tmp_path, "step_1", seq=seq)
    with pytest.raises(CheckpointError) as err:
        layout.scan_dir(tmp_path)
    assert str(path) in str(err.value) and "seq=" in str(err.value) and "integer >= 0" in str(err.value)


def test_a_latest_symlink_is_ignored_and_its_target_never_quoted(tmp_path, caplog):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    root = tmp_path / "ckpt"
    _commit(root, "step_3")
    (root / layout.LATEST_FILE).symlink_to(secret)
    state = layout.scan_dir(root)
    info, warning = layout.resolve_tag(state, None)
    assert info.tag == "step_3" and state.latest is None
    assert "symlink" in warning and SECRET not in warning
    (root / layout.LATEST_FILE).unlink()
    (root / layout.LATEST_FILE).write_text(SECRET + " /etc")   # plain file, not a tag: not quoted either
    assert SECRET not in layout.resolve_tag(layout.scan_dir(root), None)[1]
    (root / layout.LATEST_FILE).unlink()
    os.mkfifo(root / layout.LATEST_FILE)                     # a FIFO: read without blocking, ignored
    assert layout.scan_dir(root).latest is None
    (root / layout.LATEST_FILE).unlink()
    (root / layout.COMMIT_FILE).symlink_to(secret)           # records are never read through a link
    (root / "step_3" / layout.COMMIT_FILE).unlink()
    (root / "step_3" / layout.COMMIT_FILE).symlink_to(secret)
    with pytest.raises(CheckpointError, match="symlink") as err:
        layout.scan_dir(root)
    assert SECRET not in str(err.value)


def test_symlinked_tag_directories_are_not_checkpoints_and_never_deleted(tmp_path):
    victim = _victim(tmp_path)
    _commit(tmp_path / "A", "step_3")
    root = tmp_path / "B"
    root.mkdir()
    (root / "step_3").symlink_to(tmp_path / "A" / "step_3")
    (root / "step_9").symlink_to(victim)
    (root / f"{layout.TRASH_PREFIX}x").symlink_to(victim)
    state = layout.scan_dir(root)
    assert state.tags == {} and layout.resolve_tag(state, None) == (None, None)
    with pytest.raises(CheckpointError, match="does not exist"):
        layout.resolve_tag(state, "step_3")
    for tag in ("step_3", "step_9"):
        with pytest.raises(CheckpointError, match="symlink"):
            layout.discard_tag(root, tag)
        with pytest.raises(CheckpointError, match="symlink"):
            layout.tag_path(root, tag, to_write=True)
    layout.empty_trash(root)
    assert _tree(victim) == {"keep.txt": "keep"} and (tmp_path / "A" / "step_3" / layout.COMMIT_FILE).exists()


# ---------------------------------------------------------------------- the Determined layer

@pytest.fixture
def trial(tmp_path, monkeypatch):
    """A real ``det.core.init()`` trial: output dir ``out``, storage ``out/checkpoints``."""
    for key in list(os.environ):
        if key.startswith("TOOLKIT_") or key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            monkeypatch.delenv(key)
    (tmp_path / "exp.yaml").write_text("entrypoint: python3 x.py\n")
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(tmp_path / "exp.yaml"))
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(tmp_path / "out"))
    resets.forget_cluster_info()
    environ = dict(os.environ)
    yield tmp_path
    resets.forget_cluster_info()
    resets.forget_distributed()  # det.core.init() made toolkit's process group (world size 1) here
    os.environ.clear()           # and exported the launch variables it read
    os.environ.update(environ)


def _store(ckpt, step: int) -> str:
    with ckpt.store_path({"steps_completed": step}) as (path, sid):
        (path / "w").write_text(str(step))
    return sid


def test_determined_ids_from_the_script_delete_and_read_nothing_outside(trial):
    victim = _victim(trial)
    (trial / "out" / "somewhere").mkdir(parents=True)
    with det.core.init() as core:
        ckpt = core.checkpoint
        ids = [_store(ckpt, 1), _store(ckpt, 2)]
        root = trial / "out" / "checkpoints"
        (root / "link").symlink_to(victim)
        (victim / storage.METADATA_NAME).write_text("{}")
        other = str(uuid.uuid4())                           # another trial's checkpoint in the same root
        (root / other).mkdir()
        (root / other / storage.METADATA_NAME).write_text("{}")
        before = _tree(trial)
        for bad in ["../../somewhere", "../somewhere", str(victim), "", ".", "..", "a\0b", "x" * 5000]:
            for call in (ckpt.delete, ckpt.get_metadata, lambda s: ckpt.download(s, trial / "copy"),
                         lambda s: ckpt.restore_path(s).__enter__()):
                with pytest.raises(ConfigError, match="storage_id="):
                    call(bad)
        with pytest.raises(det.errors.CheckpointNotFound):   # safe name, but not this trial's record
            ckpt.delete(other)
        for call in (ckpt.get_metadata, lambda s: ckpt.restore_path(s).__enter__()):
            with pytest.raises(det.errors.CheckpointNotFound):  # a symlink out of the root: no checkpoint
                call("link")
        assert _tree(trial) == before
        ckpt.delete(ids[0])                                  # what the trial committed: deleted
        assert not (root / ids[0]).exists() and (root / ids[1]).exists() and (root / other).exists()
    assert _tree(victim) == {"keep.txt": "keep", storage.METADATA_NAME: "{}"}


def test_a_forged_registry_deletes_nothing_but_toolkits_own_leftovers(trial):
    victim = _victim(trial)
    out, root = trial / "out", trial / "out" / "checkpoints"
    root.mkdir(parents=True)
    linked, committed, leftover, named = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4()), "data"
    (root / linked).symlink_to(victim)
    (root / committed).mkdir()
    (root / committed / storage.METADATA_NAME).write_text("{}")
    (root / leftover).mkdir()                               # what an interrupted store_path leaves
    (root / leftover / "partial").write_text("x")
    (root / named).mkdir()
    (root / named / "user.txt").write_text("mine")
    pending = ["../../victim", str(victim), "", "..", ".", named, linked, committed, leftover, 5, None]
    forged = [{"storage_id": s} for s in ("../../victim", str(victim), "", linked)]
    storage.write_registry(out, {"root": str(root), "committed": forged, "pending": pending})
    with det.core.init(checkpoint_storage={"storage_path": str(root), "save_trial_latest": 1}) as core:
        assert not (root / leftover).exists()                # toolkit's own leftover: removed
        for sid in ("../../victim", str(victim), ""):
            with pytest.raises(ConfigError):
                core.checkpoint.delete(sid)
        with pytest.raises(CheckpointError, match="symlink"):
            core.checkpoint.delete(linked)                   # recorded, but a link: never followed
        _store(core.checkpoint, 1)                           # save_trial_latest=1 dooms every forged entry
    assert _tree(victim) == {"keep.txt": "keep"}
    assert (root / named / "user.txt").read_text() == "mine" and (root / committed).is_dir()
    assert (root / linked).is_symlink()


@SETTINGS
@given(sid=NAMEISH)
def test_no_storage_id_deletes_or_reads_outside_the_root(tmp_path, sid):
    victim = _victim(tmp_path)
    root = tmp_path / "c"
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=root, output_dir=tmp_path / "o")
    if not root.exists():
        _store(ckpt, 1)
        (root / "x").symlink_to(victim)
    before = _tree(tmp_path)
    for call in (ckpt.delete, ckpt.get_metadata, lambda s: ckpt.restore_path(s).__enter__()):
        try:
            call(sid)
        except (ConfigError, det.errors.CheckpointNotFound):
            pass
    assert _tree(tmp_path) == before and _tree(victim) == {"keep.txt": "keep"}


def test_a_storage_id_broadcast_by_the_chief_is_checked_on_every_rank(tmp_path):
    class OtherRank:
        """Rank 1 of 2, whose chief broadcasts ``../victim``: a second rank cannot run in this
        process, so this stands for the real collective (exercised in test_determined_e2e.py)."""

        rank, local_rank, size = 1, 1, 2

        def broadcast(self, value):
            return "../victim"

    victim = _victim(tmp_path)
    ckpt = CheckpointContext(OtherRank(), root=tmp_path / "c", output_dir=tmp_path / "o")
    with pytest.raises(CheckpointError, match="storage_id='../victim'"):
        with ckpt.store_path({}, shard=True) as (path, _):
            (path / "w").write_text("written through the forged id")
    assert _tree(victim) == {"keep.txt": "keep"}


def test_a_damaged_registry_is_a_clear_error(tmp_path):
    for text in ("{trunc", "[]", '{"committed": 5}', '{"committed": [{"id": 1}]}', '{"pending": "x"}'):
        (tmp_path / storage.REGISTRY_NAME).write_text(text)
        with pytest.raises(CheckpointError, match=storage.REGISTRY_NAME):
            storage.read_registry(tmp_path)


# ------------------------------------------------------------------ one real DeepSpeed engine

PROBE = r'''
import json, logging, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import ckpt_common as c
import toolkit
from toolkit.errors import CheckpointError

base = Path(sys.argv[1])
logging.basicConfig(filename=base / "log.txt", level=logging.WARNING)
toolkit.init_distributed()
engine = c.build("zero0")
c.train_step(engine)
toolkit.save_checkpoint(engine, base / "A", steps_completed=3)
meta = json.loads((base / "A" / "step_3" / "toolkit_checkpoint.json").read_text())
(base / "B" / "x").mkdir(parents=True)
(base / "B" / "x" / "toolkit_checkpoint.json").write_text(json.dumps({**meta, "tag": "../A/step_3"}))
(base / "C").mkdir()
(base / "C" / "step_3").symlink_to(base / "A" / "step_3")
(base / "D" / "out").mkdir(parents=True)
(base / "D" / "ckpt").mkdir()
(base / "D" / "ckpt" / "step_5").symlink_to(base / "D" / "out")
record = {}
def attempt(name, fn):
    try:
        record[name] = ["ok", repr(fn())]
    except (CheckpointError, ValueError) as err:
        record[name] = ["error", f"{type(err).__name__}: {err}"]
attempt("forged_tag", lambda: toolkit.load_checkpoint(engine, base / "B"))
attempt("symlinked_dir", lambda: toolkit.load_checkpoint(engine, base / "C"))
attempt("symlinked_tag", lambda: toolkit.load_checkpoint(engine, base / "C", tag="step_3"))
attempt("save_through_link", lambda: toolkit.save_checkpoint(engine, base / "D" / "ckpt", steps_completed=5))
(base / "A" / "latest").unlink()
(base / "A" / "latest").symlink_to(base / "secret.txt")
attempt("latest_symlink", lambda: toolkit.load_checkpoint(engine, base / "A"))
(base / "record.json").write_text(json.dumps(record))
'''


def test_end_to_end_with_a_real_engine(tmp_path):
    (tmp_path / "secret.txt").write_text(SECRET)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    procutil.check(procutil.run([sys.executable, str(script), str(tmp_path), str(procutil.WORKERS)],
                                timeout=240))
    record = json.loads((tmp_path / "record.json").read_text())
    kind, message = record["forged_tag"]
    assert kind == "error" and "CheckpointError" in message and "'../A/step_3'" in message, record
    assert record["symlinked_dir"] == ["ok", "None"], record      # the link is not a checkpoint of C
    assert record["symlinked_tag"][0] == "error" and "does not exist" in record["symlinked_tag"][1]
    assert record["save_through_link"][0] == "error" and "symlink" in record["save_through_link"][1]
    assert list((tmp_path / "D" / "out").iterdir()) == []         # nothing written through the link
    assert record["latest_symlink"][0] == "ok" and record["latest_symlink"][1].startswith("(3,"), record
    log = (tmp_path / "log.txt").read_text()
    assert "symlink" in log and SECRET not in log and SECRET not in json.dumps(record)
