"""The on-disk layout and commit protocol of toolkit checkpoints; no DeepSpeed, no collectives.

A tag directory is a checkpoint only once its commit marker ``toolkit_checkpoint.json`` exists;
anything without toolkit's markers is never chosen, replaced or deleted. The decisions
(:func:`resolve_tag`, :func:`plan_save`, :func:`plan_keep_last`, :func:`compatibility_problems`)
are pure, any rank; :func:`scan_dir` and the effects at the end are the chief's thin shell.
The layout and the protocol: docs/training.md (What a save writes, and when it counts)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

from toolkit import _names
from toolkit._files import atomic_write, fsync_dir
from toolkit.checkpoint import records
from toolkit.checkpoint.records import name_problem, read_pointer, validate_name
from toolkit.errors import CheckpointError, ConfigError

__all__ = ["checkpoint_root", "name_problem", "validate_name", "tag_path", "scan_dir", "read_pointer",
           "resolve_tag", "plan_save", "plan_keep_last", "compatibility_problems", "DirState", "TagInfo",
           "SavePlan"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
RUN_FILE = "toolkit_run.json"
STARTED_FILE = "toolkit_save_started.json"
COMMIT_FILE = "toolkit_checkpoint.json"
RNG_DIR = "toolkit_rng"
LATEST_FILE = "latest"
TRASH_PREFIX = ".toolkit-trash-"
# What DeepSpeed and toolkit put in a tag directory; only such directories may ever be deleted.
_CHECKPOINT_ENTRY_RE = re.compile(
    r".*\.pt|toolkit_.*|.*\.tmp|zero_to_(fp32|torch)\.py|offloaded_tensors|zero")
_DEEPSPEED_FILE_RE = re.compile(r".*[_-](model|optim)_states\.pt")


def checkpoint_root(checkpoint_dir: Any, *, what: str = "checkpoint_dir") -> str:
    """The checkpoint directory as a string, checked before anything touches it: ConfigError unless a
    non-empty path without scheme, CheckpointError when it exists and is no directory. Any rank."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
        raise ConfigError(f"{what}={checkpoint_dir!r}: expected a non-empty path (str or pathlib.Path)")
    root = os.fspath(checkpoint_dir)
    if isinstance(root, str) and "://" in root.split("/", 3)[0] + "//":
        raise ConfigError(f"{what}={_names.shown(root)}: expected a local or shared directory here (a "
                          "path without scheme); only save_checkpoint and load_checkpoint take s3:// and "
                          "gs:// URLs")
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{what}={root!r} exists and is not a directory; pass a directory "
                              "(it is created if missing)")
    return str(root)


def tag_path(root: str | os.PathLike[str], tag: Any, *, to_write: bool = False) -> Path:
    """``root/tag`` resolved, for a tag from disk or another rank (``to_write``: no symlink at all, no
    file in its place); CheckpointError for an unsafe name or a link out of ``root``. Any rank."""
    if to_write:
        _names.real_child(root, validate_name(tag), what="tag")
    return _names.resolve_inside(root, validate_name(tag), what="tag")


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclasses.dataclass(frozen=True)
class TagInfo:
    """What one sub-directory of a checkpoint directory holds."""

    tag: str
    entries: tuple[str, ...]
    metadata: Mapping[str, Any] | None = None

    @property
    def committed(self) -> bool:
        return self.metadata is not None

    @property
    def meta(self) -> Mapping[str, Any]:
        """The commit metadata; empty when the tag is not committed."""
        return self.metadata or {}

    @property
    def started(self) -> bool:
        return STARTED_FILE in self.entries

    @property
    def only_checkpoint_entries(self) -> bool:
        """Only what DeepSpeed or toolkit write into a tag directory (so it may be deleted)."""
        return all(_CHECKPOINT_ENTRY_RE.fullmatch(name) for name in self.entries)

    @property
    def seq(self) -> int:
        return int(self.metadata.get("seq", -1)) if self.metadata else -1

    @property
    def foreign(self) -> bool:
        """DeepSpeed files that toolkit did not start writing (``engine.save_checkpoint`` directly)."""
        return (any(_DEEPSPEED_FILE_RE.fullmatch(name) for name in self.entries)
                and not self.started and not self.committed)


@dataclasses.dataclass(frozen=True)
class DirState:
    """A snapshot of a checkpoint directory, from :func:`scan_dir`."""

    root: str
    run: Mapping[str, Any] | None
    latest: str | None
    tags: Mapping[str, TagInfo]
    latest_problem: str | None = None   # why ``latest`` is present but ignored (never its content)

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.get("run_id")

    def committed(self) -> list[TagInfo]:
        """Committed checkpoints, oldest first (by commit sequence number)."""
        return sorted((t for t in self.tags.values() if t.committed), key=lambda t: (t.seq, t.tag))


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """What the chief must do before the ranks write a checkpoint, from :func:`plan_save`."""

    run_id: str
    write_run_file: bool
    seq: int
    discard: tuple[str, ...] = ()
    new_latest: str | None = None      # repoint ``latest`` here before discarding ...
    remove_latest: bool = False        # ... or remove it (the tag it names is being replaced)
    warnings: tuple[str, ...] = ()     # worth a WARNING: taking over another run's directory
    notes: tuple[str, ...] = ()        # routine: replacing this run's own checkpoint of the same tag


def scan_dir(root: str | os.PathLike[str]) -> DirState:
    """Read the markers of a checkpoint directory (missing: an empty state). Any rank.

    Tag directories are the safely named real directories in ``root`` (symlinks are never toolkit's);
    a commit record that does not name its own directory, or has a damaged ``seq``, is a
    CheckpointError naming the file."""
    path = Path(root)
    tags: dict[str, TagInfo] = {}
    latest = latest_problem = None
    if path.is_dir():
        latest, latest_problem = records.read_pointer(path, LATEST_FILE)
        for entry in sorted(path.iterdir()):
            if entry.is_symlink() or not entry.is_dir() or _names.name_problem(entry.name):
                continue
            names = tuple(sorted(child.name for child in entry.iterdir()))
            metadata = records.read_record(entry / COMMIT_FILE) if COMMIT_FILE in names else None
            problem = None if metadata is None else records.commit_problem(metadata, entry.name)
            if problem:
                raise CheckpointError(f"{entry / COMMIT_FILE}: {problem}; the file is damaged or was not "
                                      f"written by toolkit: delete {entry} or load another tag")
            tags[entry.name] = TagInfo(tag=entry.name, entries=names, metadata=metadata)
    return DirState(root=str(path), run=records.read_record(path / RUN_FILE), latest=latest, tags=tags,
                    latest_problem=latest_problem)


def resolve_tag(state: DirState, tag: str | None) -> tuple[TagInfo | None, str | None]:
    """Which committed checkpoint to load: ``(info, warning)``, ``(None, None)`` when none is.

    ``tag=None`` follows ``latest`` when it names a committed checkpoint (DeepSpeed's convention:
    pointing it at an older tag rolls back), else the newest committed. ConfigError for an unsafe
    ``tag``; CheckpointError for a ``tag`` not committed, or DeepSpeed checkpoints without toolkit's."""
    committed = state.committed()
    names = ", ".join(repr(t.tag) for t in committed) or "none"
    if tag is not None:
        problem = name_problem(tag)
        if problem:
            raise ConfigError(problem)
        info = state.tags.get(tag)
        if info is None:
            raise CheckpointError(f"tag {tag!r} does not exist in {state.root}; committed checkpoints "
                                  f"there: {names}. Pass one of them, or tag=None for the latest")
        if not info.committed:
            why = ("its save was interrupted before every rank finished" if info.started
                   else "it was not written by toolkit.save_checkpoint")
            raise CheckpointError(f"tag {tag!r} in {state.root} has no {COMMIT_FILE}: {why}. Committed "
                                  f"checkpoints there: {names}")
        return info, None
    if not committed:
        foreign = sorted(t.tag for t in state.tags.values() if t.foreign)
        if foreign:
            raise CheckpointError(
                f"{state.root} holds DeepSpeed checkpoints not written by toolkit.save_checkpoint "
                f"({', '.join(map(repr, foreign))}; no {COMMIT_FILE}). Load them with "
                "engine.load_checkpoint(), or use another checkpoint_dir for toolkit checkpoints")
        return None, None
    if state.latest is not None and state.latest in state.tags and state.tags[state.latest].committed:
        return state.tags[state.latest], None
    chosen = committed[-1]
    if state.latest_problem:
        why = state.latest_problem
    elif state.latest is None:
        why = f"{state.root}/{LATEST_FILE} is missing"
    else:
        why = f"{state.root}/{LATEST_FILE} names {state.latest!r}, which is not committed"
    return chosen, f"{why}; using the newest committed checkpoint {chosen.tag!r}"


def _other_run_error(state: DirState, mine: str | None) -> CheckpointError:
    last = state.committed()[-1] if state.committed() else None
    detail = (f"latest committed: {last.tag!r} at steps_completed={last.meta.get('steps_completed')}, "
              f"world size {last.meta.get('world_size')}" if last else "DeepSpeed checkpoints without "
              "toolkit markers")
    owner = f"run {state.run_id}" if state.run_id else "another run"
    you = f"this run ({mine})" if mine else "this process, which has not loaded from it"
    return CheckpointError(
        f"{state.root} holds checkpoints of {owner} ({detail}), not of {you}. To resume that run, call "
        "toolkit.load_checkpoint(engine, checkpoint_dir) before saving; to start a new run, use an empty "
        "directory; to write into it anyway, pass overwrite=True (keep_last may then delete that run's "
        "checkpoints)")


def plan_save(state: DirState, *, tag: str, mine: str | None, overwrite: bool) -> SavePlan:
    """Decide whether this run may save ``tag`` into the directory, and what to clean first. Pure.

    ``mine``: this run's id for the directory (given, adopted by a load, or set by an earlier save of
    this process; None: none of these). CheckpointError when the directory or the tag is someone
    else's and ``overwrite`` is false."""
    committed = state.committed()
    foreign = [t for t in state.tags.values() if t.foreign]
    warnings: list[str] = []
    if state.run_id is None:
        if (committed or foreign) and not overwrite:
            raise _other_run_error(state, mine)
        run_id, write_run = mine or new_run_id(), True
    elif mine == state.run_id:
        run_id, write_run = mine, False
    elif committed and not overwrite:
        raise _other_run_error(state, mine)
    elif mine is None and not committed:
        run_id, write_run = state.run_id, False   # nothing to lose: continue the directory's run
    else:
        run_id, write_run = mine or new_run_id(), True
        warnings.append(f"taking over {state.root} from run {state.run_id} as run {run_id}")

    discard: list[str] = []
    notes: list[str] = []
    info = state.tags.get(tag)
    new_latest, remove_latest = None, False
    if info is not None:
        if info.committed:
            notes.append(f"replacing the committed checkpoint {tag!r} "
                         f"(steps_completed={info.meta.get('steps_completed')})")
            if state.latest == tag:
                others = [t for t in committed if t.tag != tag]
                new_latest, remove_latest = (others[-1].tag, False) if others else (None, True)
            discard.append(tag)
        elif info.started:
            discard.append(tag)        # leftover of an interrupted save of the same tag
        elif not info.entries:
            pass                       # an empty directory: nothing to lose
        elif overwrite and info.only_checkpoint_entries:
            discard.append(tag)
        else:
            raise CheckpointError(
                f"{Path(state.root) / tag} exists and was not written by toolkit.save_checkpoint "
                f"({'DeepSpeed files' if info.foreign else 'it holds other files'}); choose another tag"
                + (" or pass overwrite=True" if info.only_checkpoint_entries else ""))
    seq = max((t.seq for t in committed), default=-1) + 1
    return SavePlan(run_id=run_id, write_run_file=write_run, seq=seq, discard=tuple(discard),
                    new_latest=new_latest, remove_latest=remove_latest, warnings=tuple(warnings),
                    notes=tuple(notes))


def plan_keep_last(state: DirState, *, keep_last: int, just_written: str) -> list[str]:
    """Tags to delete after ``just_written`` was committed: older committed ones beyond ``keep_last``
    (by commit order; the new one is always kept) and leftovers of interrupted saves."""
    committed = [t.tag for t in state.committed() if t.tag != just_written]
    excess = committed[:max(0, len(committed) - (keep_last - 1))]
    leftovers = [t.tag for t in state.tags.values()
                 if t.started and not t.committed and t.tag != just_written]
    return excess + sorted(leftovers)


_COMPARED = (
    ("data_parallel_size", "data-parallel size"),
    ("tensor_parallel_size", "tensor-parallel size"),
    ("pipeline", "pipeline engine"),
    ("pipeline_stages", "pipeline stages"),
    ("zero_stage", "ZeRO stage"),
)


def compatibility_problems(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Differences between a checkpoint's metadata and this engine that DeepSpeed cannot load across."""
    problems = []
    for key, label in _COMPARED:
        if saved.get(key) != current.get(key):
            problems.append(f"{label}: saved {saved.get(key)!r}, this engine {current.get(key)!r}")
    if problems and saved.get("world_size") != current.get("world_size"):
        problems.append(f"world size: saved {saved.get('world_size')}, now {current.get('world_size')}")
    return problems


def universal_fix(root: str, tag: str) -> str:
    """How to change world size, ZeRO stage or parallel layout: a DeepSpeed universal checkpoint."""
    src = Path(root) / tag
    return (f"Restart with the saved layout, or convert the checkpoint to a DeepSpeed universal checkpoint "
            f"and load that: `python -m deepspeed.checkpoint.ds_to_universal --input_folder {src} "
            f"--output_folder {src}_universal --inject_missing_state`, then set "
            "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config and call "
            f"toolkit.load_checkpoint(engine, {str(root)!r}, tag={tag + '_universal'!r}). "
            "For the weights alone, toolkit.consolidate_checkpoint() writes a plain state_dict")


# ---------------------------------------------------------------------------------------- effects

def set_latest(root: str | os.PathLike[str], tag: str | None) -> None:
    """Point DeepSpeed's ``latest`` at ``tag`` atomically, or remove it for ``None``."""
    path = Path(root) / LATEST_FILE
    if tag is not None:
        atomic_write(path, tag.encode())
    elif path.exists():
        path.unlink()
        fsync_dir(root)


def discard_tag(root: str | os.PathLike[str], tag: str) -> None:
    """Delete a tag directory: first renamed out of sight (atomic), so that a crash in the middle
    never leaves a half-deleted checkpoint under its name; then removed. Only a real directory
    directly inside ``root`` under a safe name is removed (:func:`toolkit._names.real_child`)."""
    if _names.real_child(root, tag, what="tag") is None:
        return
    trash = Path(root) / f"{TRASH_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
    os.rename(Path(root) / tag, trash)
    fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)


def empty_trash(root: str | os.PathLike[str]) -> None:
    """Remove what an interrupted :func:`discard_tag` left behind (real directories only, no links)."""
    for entry in Path(root).glob(f"{TRASH_PREFIX}*"):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
