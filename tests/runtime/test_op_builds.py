"""toolkit.runtime.op_builds and build_env: no silent wait on an op's build lock, one build per environment.

Real processes, real locks, real builds: the lock states are made by real holders (a process that
keeps the file open, one that works in the op's directory), and the end-to-end tests start
``toolkit.init_distributed`` (which loads ``deepspeed_shm_comm`` on the CPU) against a lock left
as a killed load leaves it, and stop cold and warm start-ups at several moments. The ninja and
directory tests load a tiny op of this suite's from processes with different PATHs and from a
second real virtual environment whose ninja is another version (the system's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from helpers import procutil
from toolkit.runtime import build_env, op_builds
from toolkit.runtime.op_builds import builders_for, clear_dead_locks, extensions_root, judge_lock

OP = "deepspeed_shm_comm"
# One write of a few bytes to the shared pipe is atomic: two ranks' lines cannot interleave (print's
# separate writes of "ready", " 2" and "\n" did, unbuffered).
INIT = ("import os, toolkit; ctx = toolkit.init_distributed(); "
        "os.write(1, f'ready {ctx.world_size}\\n'.encode())")
PROBE_OP = "toolkit_probe_op"
PROBE = ("import toolkit; toolkit.install_build_guards(); from torch.utils.cpp_extension import load; "
         f"load({PROBE_OP!r}, [{str(procutil.WORKERS / 'op_build_probe.cpp')!r}]); print('ready 1')")


# -- pure ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, on_cpu, expected", [
    ({"optimizer": {"type": "Adam"}}, True, ["ShareMemCommBuilder", "FusedAdamBuilder"]),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, True, ["ShareMemCommBuilder"]),
    ({"optimizer": {"type": "AdamW"},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, False, ["CPUAdamBuilder"]),
    ({"optimizer": {"type": "Lamb"}}, False, ["FusedLambBuilder"]),
    ({"optimizer": {"type": "Lamb"}}, True, ["ShareMemCommBuilder"]),
    ({"optimizer": {"type": "Lion"}}, False, ["FusedLionBuilder"]),
    ({"optimizer": {"type": "Adagrad"}, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     False, ["CPUAdagradBuilder", "AsyncIOBuilder"]),
    ({"optimizer": {"type": "SGD"}}, False, []),
    ({"optimizer": "junk", "zero_optimization": None}, False, []),
])
def test_builders_follow_deepspeeds_choice_of_optimizer(config, on_cpu, expected):
    assert builders_for([config], on_cpu=on_cpu) == expected


def test_extensions_root_follows_torch_once_guarded(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    op_builds.install_build_guards()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    assert Path(cpp_extension._get_build_directory("probe_op", False)).parent == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    # unset: a subdirectory of torch's default, keyed by this environment (its ninja, torch, DeepSpeed)
    root = extensions_root()
    assert root.parent == build_env.torch_default_root() and root.name.startswith("toolkit-")
    assert Path(cpp_extension._get_build_directory("probe_op", False)).parent == root
    assert (root / "toolkit-environment.json").is_file()


def test_a_build_sees_this_environments_ninja_first_on_path_and_path_comes_back(monkeypatch):
    ninja = build_env.pinned_ninja()
    if ninja is None:
        pytest.skip("no ninja here (pip install ninja)")
    monkeypatch.setenv("PATH", "/nowhere")
    with build_env.ninja_first(), build_env.ninja_first():      # nested: two threads' builds
        assert os.environ["PATH"] == f"{os.path.dirname(ninja)}{os.pathsep}/nowhere"
        assert shutil.which("ninja") == ninja
    assert os.environ["PATH"] == "/nowhere"
    monkeypatch.setenv("PATH", f"{os.path.dirname(ninja)}{os.pathsep}/nowhere")
    with build_env.ninja_first():                               # already first: nothing changes
        assert os.environ["PATH"] == f"{os.path.dirname(ninja)}{os.pathsep}/nowhere"


# -- who holds a lock --------------------------------------------------------------------------

def _lock(tmp_path: Path, op: str = "some_op") -> Path:
    (tmp_path / op).mkdir(parents=True, exist_ok=True)
    lock = tmp_path / op / "lock"
    lock.touch()
    return lock


def _holder(code: str, cwd: Path | None = None) -> subprocess.Popen:
    code += "\nprint('in', flush=True)\nimport time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdout=subprocess.PIPE, text=True,
                            env=procutil.child_env())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "in"
    return proc


def test_a_lock_nobody_holds_is_dead_and_one_held_open_is_held(tmp_path):
    lock = _lock(tmp_path)
    assert judge_lock(lock).kind == "dead"
    holder = _holder(f"import os; fd = os.open({str(lock)!r}, os.O_RDONLY)")
    try:
        state = judge_lock(lock)
        assert state.kind == "held" and f"pid {holder.pid}" in state.detail
    finally:
        holder.kill()
        holder.wait(10)
    assert judge_lock(lock).kind == "dead"
    lock.unlink()
    assert judge_lock(lock).kind == "free"


def test_a_build_running_in_the_ops_directory_holds_its_lock(tmp_path):
    lock = _lock(tmp_path)
    holder = _holder("pass", cwd=lock.parent)   # what ninja and its compilers look like
    try:
        state = judge_lock(lock)
        assert state.kind == "held" and "a build runs in its directory" in state.detail
    finally:
        holder.kill()
        holder.wait(10)


def test_a_lock_taken_on_another_host_cannot_be_judged_here(tmp_path):
    lock = _lock(tmp_path)
    lock.write_text(f"not-{socket.gethostname()} 123\n")
    assert judge_lock(lock).kind == "unseen"
    lock.write_text(f"{socket.gethostname()} 123\n")
    assert judge_lock(lock).kind == "dead"


def test_clear_dead_locks_removes_only_dead_ones(tmp_path):
    dead, held = _lock(tmp_path, "a_op"), _lock(tmp_path, "b_op")
    holder = _holder(f"import os; fd = os.open({str(held)!r}, os.O_RDONLY)")
    try:
        assert clear_dead_locks(tmp_path) == [dead]
        assert not dead.exists() and held.exists()
    finally:
        holder.kill()
        holder.wait(10)


def test_a_dead_lock_is_removed_only_while_it_is_the_one_judged_dead(tmp_path):
    lock = _lock(tmp_path)
    judged = judge_lock(lock)
    assert judged.kind == "dead"
    os.utime(lock, ns=(judged.ident[1] + 10**9, judged.ident[1] + 10**9))   # taken again meanwhile
    assert not op_builds.remove_dead_lock(lock, judged.ident) and lock.exists()
    holder = _holder(f"import os; fd = os.open({str(lock)!r}, os.O_RDONLY)")
    try:
        assert not op_builds.remove_dead_lock(lock, judge_lock(lock).ident) and lock.exists()   # held
    finally:
        holder.kill()
        holder.wait(10)
    assert op_builds.remove_dead_lock(lock, judge_lock(lock).ident) and not lock.exists()
    # an ended process has no command line to show
    assert op_builds._command(str(holder.pid)) == "?"


def test_a_wait_on_an_unseen_holder_ends_with_an_error_naming_the_lock(tmp_path, monkeypatch):
    lock = _lock(tmp_path)
    lock.write_text("elsewhere 1\n")
    monkeypatch.setattr(op_builds, "UNSEEN_HOLDER_LIMIT_S", 1.5)
    start = time.monotonic()
    with pytest.raises(op_builds.BuildLockError, match=f"rm {lock}"):
        op_builds._wait_for(lock)
    assert time.monotonic() - start < 10


# -- end to end: init_distributed against left locks and stops -------------------------------------

@pytest.fixture(scope="module")
def warm_ext(tmp_path_factory) -> Path:
    """An extension directory of this module's own holding the built shared-memory op (copied, with
    its ninja records, from the suite's), so that the locks made here reach no other test."""
    source = extensions_root() / OP
    if not (source / f"{OP}.so").exists():
        pytest.skip(f"{source} holds no built {OP} (scripts/setup.sh builds it)")
    root = tmp_path_factory.mktemp("ext")
    shutil.copytree(source, root / OP, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    return root


def _start(code: str, ext: Path, *, nproc: int = 1) -> subprocess.Popen:
    """``python -c code``, or with ``nproc`` > 1 the same code as a script under torchrun."""
    argv = [sys.executable, "-c", code]
    if nproc > 1:
        script = ext / "init_script.py"
        script.write_text(code)
        argv = procutil.torchrun_argv(script, nproc=nproc)
    env = procutil.child_env(TORCH_EXTENSIONS_DIR=str(ext))
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as err:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"not done within {timeout} s (a silent wait?); output:\n{out[-4000:]}") from err
    assert proc.returncode == 0, f"exit {proc.returncode}; output:\n{out[-4000:]}"
    return out


def test_two_ranks_start_past_a_lock_left_by_a_killed_load(warm_ext):
    lock = warm_ext / OP / "lock"
    lock.touch()   # what a process killed between taking the lock and releasing it leaves
    out = _finish(_start(INIT, warm_ext, nproc=2), timeout=120)
    assert out.count("ready 2") == 2
    assert "left by a process that died" in out
    assert not lock.exists()


def _stop_during_start(code: str, ext: Path, at_s: float, sig: int) -> None:
    proc = _start(code, ext)
    time.sleep(at_s)
    if proc.poll() is None:
        os.kill(proc.pid, sig)  # the process only: a compiler it started lives on, as after a real stop
    # A stop the process handles (SIGTERM once toolkit watches for it) may let a cold build finish
    # first: a minute or more on a busy machine. A wait past 300 s is a hang.
    proc.communicate(timeout=300)


def test_a_stop_at_any_moment_of_a_warm_start_leaves_the_next_run_working(warm_ext):
    """Stops spread over a warm start-up (imports, process group, the op's load and lock), one of
    each kind: early (imports), middle, late (the op's load on a busy machine)."""
    stops = ((signal.SIGTERM, 0.5), (signal.SIGINT, 2.5), (signal.SIGKILL, 4.5))
    for sig, at_s in stops:
        _stop_during_start(INIT, warm_ext, at_s, sig)
        assert "ready 1" in _finish(_start(INIT, warm_ext), timeout=120), (sig, at_s)


def _parent(pid: int) -> int | None:
    """The parent pid of ``pid`` (None once it has ended)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _build_processes(lock: Path) -> list[tuple[int, str]]:
    """(pid, command) of the processes working in the op's directory: ninja and its compilers."""
    holders, _ = op_builds._local_holders(lock)
    return [(int(pid), cmd) for pid, how, cmd in holders if how == "builds"]


def _await(predicate, what: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        ended = [p.pid for p in procs if p.poll() is not None]
        if ended or time.monotonic() > end:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            outs = [proc.communicate(timeout=30)[0][-3000:] for proc in procs]
            raise AssertionError(f"{what}: not seen ({'exited: ' + str(ended) if ended else 'timed out'}); "
                                 f"output:\n" + "\n".join(outs))
        time.sleep(0.05)


def test_a_stop_during_a_cold_build_leaves_the_next_run_working(tmp_path):
    """An op is compiled from nothing: the start-up is SIGKILLed while its build runs (the lock
    stays, and ninja lives on, orphaned, in the op's directory); two more start-ups wait on that
    lock and are stopped while they wait (SIGINT, SIGTERM), and neither removes it; the same
    command then finishes, after removing the lock the killed process left.

    The op is a small extension of this suite's (tests/workers/op_build_probe.cpp), loaded the
    way DeepSpeed loads its ops (``torch.utils.cpp_extension.load``, where the lock is taken): a
    build of DeepSpeed's own costs a minute of compiling. The orphaned ninja is paused (SIGSTOP)
    while the waiters wait, so that the stops land in the wait however fast the build is."""
    ext = tmp_path / "cold"
    ext.mkdir()
    lock = ext / PROBE_OP / "lock"
    first = _start(PROBE, ext)
    _await(lambda: any(cmd.startswith("ninja") for _, cmd in _build_processes(lock)), "a build of the op",
           [first])
    # ninja's own fork before it execs a compiler shows "ninja" too: the build's ninja is the one
    # whose parent is not a ninja
    ninjas = [pid for pid, cmd in _build_processes(lock) if cmd.startswith("ninja")]
    (ninja,) = [pid for pid in ninjas if _parent(pid) not in ninjas]
    os.kill(ninja, signal.SIGSTOP)
    try:
        os.kill(first.pid, signal.SIGKILL)  # the process only: its ninja lives on, as after a real stop
        first.communicate(timeout=30)
        waiters = {signal.SIGINT: _start(PROBE, ext), signal.SIGTERM: _start(PROBE, ext)}
        for sig, proc in waiters.items():
            assert proc.stdout is not None
            lines: list[str] = []
            # The wait reports itself after 5 s, naming the build that holds the lock.
            _await(lambda: bool(lines.append(proc.stdout.readline()) or "waiting" in lines[-1]),  # noqa: B023
                   "a report of the wait on the lock", [proc])
            assert "a build runs in its directory" in lines[-1] and "ninja" in lines[-1], lines
            os.kill(proc.pid, sig)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode != 0, out[-3000:]
            assert lock.exists(), f"a waiter stopped by {sig.name} removed a lock it did not hold"
    finally:
        os.kill(ninja, signal.SIGCONT)
    out = _finish(_start(PROBE, ext), timeout=600)
    assert "ready 1" in out, out
    assert "left by a process that died" in out, out
    assert not lock.exists()


def test_an_interrupted_build_leaves_no_compiler_running(tmp_path):
    """SIGINT to the building process alone (a scheduler's signal, not a terminal's Ctrl-C to the
    group): Python's subprocess.run SIGKILLs ninja a quarter second later, before it can pass the
    interrupt on to its compilers, each in a process group of its own; the guard stops them."""
    ext = tmp_path / "cold"
    ext.mkdir()
    lock = ext / PROBE_OP / "lock"
    proc = _start(PROBE, ext)
    _await(lambda: any(not cmd.startswith(("ninja", "/bin/sh")) for _, cmd in _build_processes(lock)),
           "a compiler of the op", [proc])
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out[-3000:]
    assert "the interrupted build of toolkit_probe_op left running" in out, out[-3000:]
    assert _build_processes(lock) == [], "a compiler of the interrupted build still runs"


def test_an_op_that_cannot_be_built_is_skipped_with_a_warning(tmp_path):
    """dsat builds ops before its trials; without ninja on PATH that fails, and dsat goes on (its
    trials then meet DeepSpeed's own error)."""
    code = ("from toolkit.runtime.op_builds import load_ops; "
            "print('loaded', load_ops(['AsyncIOBuilder', 'ShareMemCommBuilder']))")
    env = procutil.child_env(TORCH_EXTENSIONS_DIR=str(tmp_path), PATH=str(tmp_path))  # no ninja, no compiler
    out = procutil.check(procutil.run([sys.executable, "-c", code], env=env, timeout=120))
    assert "loaded []" in out and "could not build DeepSpeed's op deepspeed_shm_comm" in out
    # async_io needs libaio and a compiler to probe for it: DeepSpeed finds it incompatible, no build tried
    assert "async_io" not in out


# -- nothing on import; one ninja and one build directory per environment -----------------------

_UNTOUCHED = """
import os, sys
import torch.utils.cpp_extension as ce
from deepspeed.ops.op_builder import builder      # DeepSpeed first, as a Determined script may
before, meta, env = dict(vars(ce)), list(sys.meta_path), dict(os.environ)
method = builder.CUDAOpBuilder.compute_capability_args
import toolkit, toolkit.compat.determined, toolkit.dsat.tuner_cli, toolkit.run.cli
changed = sorted(k for k, v in vars(ce).items() if before.get(k) is not v)
assert not changed and sys.meta_path == meta and dict(os.environ) == env, (changed, sys.meta_path)
assert builder.CUDAOpBuilder.compute_capability_args is method
toolkit.install_build_guards()
toolkit.install_build_guards()                     # idempotent
print(sorted(k for k, v in vars(ce).items() if before.get(k) is not v), len(sys.meta_path) - len(meta),
      builder.CUDAOpBuilder.compute_capability_args is not method, dict(os.environ) == env)
"""


def test_importing_toolkit_changes_nothing_and_install_build_guards_installs_every_guard_once():
    out = procutil.check(procutil.run([sys.executable, "-c", _UNTOUCHED], timeout=300))
    assert out.strip().splitlines()[-1] == (
        "['FileBaton', '_get_build_directory', '_jit_compile', '_run_ninja_build', 'is_ninja_available'] 1 True True")


def _second_environment(tmp_path: Path) -> Path:
    """A real second virtual environment of this Python: this one's packages (a .pth file), but the
    system's ninja in its bin/, another version than ours."""
    ours, system = build_env.pinned_ninja(), shutil.which("ninja", path="/usr/bin:/bin:/usr/local/bin")
    if ours is None or system is None or build_env._ninja_version(system) == build_env._ninja_version(ours):
        pytest.skip(f"needs a system ninja of another version than {ours} (Debian: apt install ninja-build)")
    venv = tmp_path / "venv2"
    procutil.check(procutil.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120))
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "first_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (venv / "bin" / "ninja").symlink_to(system)
    return venv / "bin" / "python"


def _links(root: Path) -> dict[str, int]:
    """Per environment directory under ``root``: how many times the probe op was linked there."""
    # .ninja_log: one line per output built, "start end mtime output command-hash"
    return {log.parent.parent.name: [line.split("\t")[3:4] for line in log.read_text().splitlines()].count(
            [f"{PROBE_OP}.so"]) for log in root.glob(f"*/{PROBE_OP}/.ninja_log")}


def test_every_process_of_an_environment_uses_its_ninja_and_environments_build_apart(tmp_path):
    """torch's default cache (TORCH_EXTENSIONS_DIR unset, a fresh HOME): this venv's python with its
    bin on PATH builds the op; the same python with only the system's ninja on PATH loads it
    without a second link; a second venv (the system's ninja) builds its own copy beside it; the
    second venv pointed at the first one's directory is respected, and says it holds another
    ninja's build."""
    python2 = _second_environment(tmp_path)
    base = procutil.child_env(HOME=str(tmp_path))
    for key in ("TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"):
        base.pop(key, None)
    venv_bin, system_path = os.path.dirname(sys.executable), "/usr/bin:/bin"

    def load(python: Path | str, path: str, **extra: str) -> str:
        return procutil.check(procutil.run([str(python), "-c", PROBE], env={**base, "PATH": path, **extra},
                                           timeout=300))

    first = load(sys.executable, f"{venv_bin}:{system_path}")
    assert "built op toolkit_probe_op" in first and "it was not built yet" in first, first
    again = load(sys.executable, system_path)     # the system's ninja first on PATH: not used
    assert "ready 1" in again and "built op" not in again, again
    root = tmp_path / ".cache" / "torch_extensions" / build_env.torch_default_root().name
    (env1,) = _links(root)
    assert _links(root) == {env1: 1}
    other = load(python2, system_path)
    assert "built op toolkit_probe_op" in other and "it was not built yet" in other, other
    env2 = next(name for name in _links(root) if name != env1)
    assert _links(root) == {env1: 1, env2: 1}
    assert not (root / PROBE_OP).exists()         # torch's own layout untouched
    explicit = load(python2, system_path, TORCH_EXTENSIONS_DIR=str(root / env1))
    assert explicit.count("holds builds of another ninja") == 1, explicit
    assert "its build was made by ninja" in explicit and _links(root) == {env1: 2, env2: 1}, explicit
