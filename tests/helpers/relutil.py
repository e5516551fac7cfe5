"""Chaos campaigns on the data-parallel example (examples/core_api/train.py, 2 ranks under torchrun).

A campaign starts the example, delivers one signal at a chosen kind of moment, waits for the
launch to end (with a timeout: a hang is a loss, not a stuck suite), checks the checkpoint
directory, and starts it again, until every planned signal was delivered; then it runs the
example to the end without signals. :func:`compare_weights` then compares the final weights
with an uninterrupted run, the way tests/test_examples.py does (consolidate, ``torch.equal``).

Moments (each one really hit, observed from the checkpoint directory, not hoped for):
    startup  a random delay after the launch, before the run's first new checkpoint begins
    save     as soon as a save is seen in progress (a tag with the started marker and no commit
             marker), plus a random delay of a few milliseconds
    step     a random delay after the run committed 1-3 new checkpoints
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import torch
import yaml

import toolkit
import toolkit.checkpoint.layout as layout
from helpers import procutil
from toolkit.launch.procs import find_trial_processes, kill_until_gone

EXAMPLES = procutil.REPO / "examples" / "core_api"
SCRIPT = EXAMPLES / "train.py"
LAUNCH_ENV = "TOOLKIT_RELIABILITY_LAUNCH"  # marks every process of one launch, to kill it on a hang
LAUNCH_TIMEOUT_S = 300.0


def small_config(directory: Path, *, checkpoint_every: int = 2) -> Path:
    """The example's own config, shrunk (as tests/test_examples.py does) to seconds per run."""
    config = yaml.safe_load((EXAMPLES / "deepspeed.yaml").read_text())
    config["hyperparameters"].update({"dataset_size": 512, "image_size": 16, "width": 8,
                                      "validate_every": 10**6,
                                      "checkpoint_every": checkpoint_every,
                                      # A signal then stops the run within about 0.5 s (two checks),
                                      # so that shots land mid-run rather than after the last step.
                                      "preemption_check_interval": 0.25})
    overrides = config["hyperparameters"].setdefault("overwrite_deepspeed_args", {})
    overrides["zero_optimization"] = {**overrides.get("zero_optimization", {}),
                                      "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}
    config["hyperparameters"]["deepspeed_config"] = str(EXAMPLES / "ds_config.json")
    path = directory / "deepspeed.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def committed_step(checkpoints: Path) -> int:
    """steps_completed of the checkpoint a resume would load (0: none)."""
    for attempt in range(20):
        try:
            info, _ = layout.resolve_tag(layout.scan_dir(checkpoints), None)
            return int(info.metadata["steps_completed"]) if info else 0
        except (OSError, toolkit.CheckpointError):  # a tag being deleted (keep_last) while we look
            if attempt == 19:
                raise
            time.sleep(0.01)
    return 0


def _started(checkpoints: Path, since: float) -> dict[str, bool]:
    """Tags whose save began after ``since`` (leftovers of killed saves are older): tag -> committed."""
    found = {}
    try:
        names = os.listdir(checkpoints)
    except FileNotFoundError:
        return found
    for name in names:
        try:
            if os.stat(checkpoints / name / layout.STARTED_FILE).st_mtime >= since:
                found[name] = (checkpoints / name / layout.COMMIT_FILE).exists()
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def _saving(checkpoints: Path, since: float) -> str | None:
    """A tag whose save began after ``since`` and is in progress (not committed yet)."""
    return next((tag for tag, committed in _started(checkpoints, since).items() if not committed), None)


def _workers(launcher_pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-f", "-P", str(launcher_pid), SCRIPT.name], capture_output=True,
                           text=True, timeout=30).stdout.split()
    return [int(pid) for pid in found]


@dataclasses.dataclass
class Shot:
    """One delivered signal and what followed."""

    index: int
    sig: str
    moment: str          # planned kind
    landed: str          # observed: startup / save / step / after-exit
    target: str          # torchrun or rank pid
    before: int          # committed steps before the launch
    after: int = -1      # committed steps after it
    exit_code: int | None = None
    resumed_from: int | None = None   # "resumed at step N" of the next launch (None: not reached)
    problems: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Campaign:
    """Signals at planned moments, each followed by a restart, then a clean run to the end."""

    def __init__(self, workdir: Path, config: Path, *, max_steps: int, rng: random.Random) -> None:
        self.workdir, self.rng, self.max_steps = workdir, rng, max_steps
        self.out = workdir / "run"
        self.checkpoints = self.out / "checkpoints"
        self.argv_tail = ["--config", str(config), "--output-dir", str(self.out),
                          "--max-steps", str(max_steps)]
        self.shots: list[Shot] = []
        self.launches = 0

    # ------------------------------------------------------------------ launching
    def _start(self) -> tuple[subprocess.Popen, Path, str]:
        self.launches += 1
        log = self.workdir / f"launch{self.launches:02d}.log"
        mark = f"{self.workdir}/launch{self.launches}"
        with open(log, "w") as fh:
            proc = subprocess.Popen(procutil.torchrun_argv(SCRIPT, *self.argv_tail),
                                    env=procutil.child_env(**{LAUNCH_ENV: mark}), stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log, mark

    def _finish(self, proc: subprocess.Popen, mark: str, timeout: float = LAUNCH_TIMEOUT_S) -> int | None:
        """The launch's exit status; None when it hung (then every process of it is killed)."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_until_gone(lambda table: find_trial_processes(mark, variable=LAUNCH_ENV, table=table),
                            grace_s=1.0, reap=[proc], what="chaos launch")

    # ------------------------------------------------------------------ one shot
    def shoot(self, sig: signal.Signals, moment: str) -> Shot:
        before = committed_step(self.checkpoints)
        self._check_resume_line()
        launched_at = time.time() - 0.05  # file times may be rounded
        proc, log, mark = self._start()
        shot = Shot(index=len(self.shots) + 1, sig=sig.name, moment=moment, landed="after-exit", target="-",
                    before=before)
        self.shots.append(shot)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        workers: list[int] = []
        if moment == "startup":
            time.sleep(self.rng.uniform(0.5, 6.0))
        else:  # the ranks are known before the moment comes, so that the signal follows it at once
            while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                workers = _workers(proc.pid)
        if moment == "save":
            while (proc.poll() is None and time.monotonic() < deadline
                   and not _saving(self.checkpoints, launched_at)):
                time.sleep(0.002)
            time.sleep(self.rng.uniform(0.0, 0.01))
        elif moment == "step":
            target_step = before + self.rng.randint(1, 3) * self._every()
            while (proc.poll() is None and time.monotonic() < deadline
                   and committed_step(self.checkpoints) < min(target_step, self.max_steps - 1)):
                time.sleep(0.02)
            time.sleep(self.rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            shot.landed = ("save" if _saving(self.checkpoints, launched_at) else
                           "startup" if not _started(self.checkpoints, launched_at) else "step")
            workers = workers or _workers(proc.pid)
            # Start-up: the scheduler's signal usually reaches the launcher; later, one rank alone
            # (the hardest case: the others must follow) or, for SIGTERM, sometimes the launcher.
            if sig == signal.SIGKILL or (workers and self.rng.random() < 0.7 and shot.landed != "startup"):
                victim = self.rng.choice(workers) if workers else proc.pid
                shot.target = f"rank pid {victim}" if workers else "torchrun"
            else:
                victim, shot.target = proc.pid, "torchrun"
            try:
                os.kill(victim, sig)
            except ProcessLookupError:
                shot.landed = "after-exit"
        shot.exit_code = self._finish(proc, mark)
        if shot.exit_code is None:
            shot.problems.append(f"launch {self.launches} hung past {LAUNCH_TIMEOUT_S:.0f} s: {log}")
        self._check_directory(shot)
        if sig == signal.SIGTERM and shot.target.startswith("rank") and shot.landed in ("save", "step"):
            # A SIGTERM to one rank after start-up is a clean preemption: checkpoint, exit 0.
            text = log.read_text(errors="replace")
            finished = f"done at step {self.max_steps};" in text  # the run ended before the stop was agreed
            if shot.exit_code != 0 or ("preempted" not in text and not finished):
                shot.problems.append(f"SIGTERM to one rank ({shot.landed}) did not stop cleanly: exit "
                                     f"{shot.exit_code}, log {log}")
        return shot

    def _every(self) -> int:
        return int(yaml.safe_load(Path(self.argv_tail[1]).read_text())["hyperparameters"]["checkpoint_every"])

    def _check_directory(self, shot: Shot) -> None:
        """The checkpoint a resume would choose is committed, complete and loadable; nothing lost."""
        try:
            state = layout.scan_dir(self.checkpoints)
            info, _ = layout.resolve_tag(state, None)
        except Exception as err:  # noqa: BLE001 - any failure to choose is a loss
            shot.problems.append(f"cannot choose a checkpoint: {type(err).__name__}: {err}")
            return
        if info is None:
            shot.after = 0
            if shot.before:
                shot.problems.append(f"committed progress lost: had step {shot.before}, now none")
            return
        shot.after = int(info.metadata["steps_completed"])
        if shot.after < shot.before:
            shot.problems.append(f"committed progress went back: {shot.before} -> {shot.after}")
        files = set(info.entries)
        needed = {layout.COMMIT_FILE, layout.STARTED_FILE, layout.RNG_DIR, "mp_rank_00_model_states.pt"}
        if not needed <= files or not any(f.endswith("optim_states.pt") for f in files):
            shot.problems.append(f"chosen checkpoint {info.tag} is incomplete: {sorted(files)}")
            return
        if len(os.listdir(self.checkpoints / info.tag / layout.RNG_DIR)) != 2:
            shot.problems.append(f"chosen checkpoint {info.tag} lacks a rank's RNG states")
        try:  # loadable, offline: every shard and the metadata are read back
            toolkit.consolidate_checkpoint(self.checkpoints, self.workdir / "probe.pt")
        except Exception as err:  # noqa: BLE001
            shot.problems.append(f"chosen checkpoint {info.tag} does not load: {type(err).__name__}: {err}")

    def _check_resume_line(self) -> None:
        """The launch before this one resumed exactly from the committed checkpoint it found."""
        if not self.shots:
            return
        shot = self.shots[-1]
        log = self.workdir / f"launch{self.launches:02d}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        marker = "resumed at step "
        if marker in text:
            resumed = int(text.split(marker, 1)[1].split()[0])
            shot.resumed_from = resumed
            if resumed != shot.before:
                shot.problems.append(f"launch resumed at step {resumed}, "
                                     f"but step {shot.before} was committed")

    # ------------------------------------------------------------------ the end
    def run_to_end(self) -> tuple[int | None, str]:
        self._check_resume_line()
        proc, log, mark = self._start()
        code = self._finish(proc, mark)
        text = log.read_text(errors="replace")
        if self.shots and self.shots[-1].after and f"resumed at step {self.shots[-1].after} " not in text:
            self.shots[-1].problems.append(f"the final launch did not resume at step {self.shots[-1].after}")
        return code, text


def run_reference(workdir: Path, config: Path, *, max_steps: int) -> Path:
    out = workdir / "reference"
    argv = procutil.torchrun_argv(SCRIPT, "--config", str(config), "--output-dir", str(out),
                                  "--max-steps", str(max_steps))
    procutil.check(procutil.run(argv, timeout=LAUNCH_TIMEOUT_S))
    return out / "checkpoints"


def final_weights(checkpoints: Path, target: Path) -> dict[str, torch.Tensor]:
    toolkit.consolidate_checkpoint(checkpoints, target)
    return torch.load(target, map_location="cpu", weights_only=True)


def compare_weights(reference: Path, candidate: Path, workdir: Path) -> list[str]:
    """Keys whose final weights differ (bitwise) between two runs; [] when identical."""
    expected = final_weights(reference, workdir / "expected.pt")
    got = final_weights(candidate, workdir / "got.pt")
    if expected.keys() != got.keys():
        return [f"keys differ: {sorted(expected.keys() ^ got.keys())}"]
    return [key for key in expected if not torch.equal(expected[key], got[key])]
