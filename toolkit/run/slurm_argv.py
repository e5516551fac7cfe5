"""What ``python -m toolkit.run ... --slurm OPTIONS`` submits, decided from the flags alone. Pure.

Each trial of the search is one Slurm job: :func:`sbatch_argv` (the submission, the user's
options last), :func:`job_script` (one ``srun`` step running the trial as ``toolkit.run`` runs it
locally, :mod:`toolkit.run.slurm_job`), :func:`parse_squeue` (the jobs' states).

Example::

    options = parse_options("--partition=gpu --time=60")
    sbatch_argv(options, script=Path("trial-0000/slurm_job.sh"), job_name="exp.trial-0000",
                output=Path("trial-0000/slurm-%j.out"), chdir=Path("."), nproc=2)
"""

from __future__ import annotations

import shlex
from pathlib import Path

from toolkit.errors import ConfigError

__all__ = ["ACTIVE_STATES", "DEFAULT_SIGNAL", "RESULT_FILE", "SPEC_FILE", "job_script", "parse_options",
           "parse_squeue", "sbatch_argv", "scancel_argv", "squeue_argv"]

#: Slurm's warning before a trial job's time limit (unless the options give ``--signal``): SIGUSR1
#: to the trial's step 3 minutes ahead (slurmctld checks only every 30 s), so that it saves and
#: stops; the search then submits it again.
DEFAULT_SIGNAL = "--signal=USR1@180"

#: In the trial's directory: what its job runs (written by the search) ...
SPEC_FILE = "slurm_trial.json"
#: ... and how the trial ended there (written by the job, :mod:`toolkit.run.slurm_job`).
RESULT_FILE = "slurm_result.json"

#: The job step's Python: the stop signals blocked from its first line (unblocked once its handlers
#: are in place), then :mod:`toolkit.run.slurm_job`.
_BOOT = ("import runpy, signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, "
         "signal.SIGUSR1}); runpy.run_module('toolkit.run.slurm_job', run_name='__main__', alter_sys=True)")

#: A job in one of these states has not ended yet (``squeue --states=all``).
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                           "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT",
                           "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT"})

# Options toolkit.run sets itself, or that change what a submission is: refused in --slurm.
_RESERVED = {"-o": "--output", "--output": "--output", "-e": "--error", "--error": "--error",
             "-D": "--chdir", "--chdir": "--chdir", "--parsable": "--parsable", "--wrap": "--wrap",
             "-a": "--array", "--array": "--array", "-W": "--wait", "--wait": "--wait",
             "-J": "--job-name", "--job-name": "--job-name", "--open-mode": "--open-mode"}


def parse_options(text: str) -> list[str]:
    """The sbatch options of ``--slurm TEXT`` (shell words), checked.

    Raises:
        ConfigError: naming ``--slurm``: unbalanced quotes, a first word that is not an option,
            or an option toolkit.run sets itself (``--output``, ``--chdir``, ``--job-name``, ...)
            or that is no single job (``--wrap``, ``--array``, ``--wait``, ``--parsable``).

    Example:
        >>> parse_options("--partition=x --time 10")
        ['--partition=x', '--time', '10']
    """
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise ConfigError(f"--slurm={text!r}: cannot be split into words ({err}); balance the quotes") \
            from None
    problems = []
    if words and not words[0].startswith("-"):
        problems.append(f"--slurm={text!r}: expected sbatch options (e.g. "
                        f"--slurm='--partition=gpu --time=60'), got {words[0]!r} first")
    for word in words:
        name = word.split("=", 1)[0]
        if not name.startswith("--") and name.startswith("-") and len(name) > 2:
            name = name[:2]  # -ofile, -Jname
        if name in _RESERVED:
            problems.append(f"--slurm: {word!r}: toolkit.run sets {_RESERVED[name]} itself (one job per "
                            "trial, its output in the trial's directory); leave it out")
    if problems:
        raise ConfigError(problems)
    return words


def _has_signal(options: list[str]) -> bool:
    return any(w == "--signal" or w.startswith("--signal=") for w in options)


def sbatch_argv(options: list[str], *, script: Path, job_name: str, output: Path, chdir: Path,
                nproc: int) -> list[str]:
    """``sbatch`` for one trial: one node, one task of ``nproc`` CPUs (torchrun starts the ranks),
    :data:`DEFAULT_SIGNAL` unless ``options`` has ``--signal``, then ``options`` (they win).

    Example:
        >>> sbatch_argv(["--time=10"], script=Path("s.sh"), job_name="e.trial-0000", output=Path("o"),
        ...             chdir=Path("m"), nproc=1)[-3:]
        ['--signal=USR1@180', '--time=10', 's.sh']
    """
    argv = ["sbatch", "--parsable", f"--job-name={job_name}", f"--output={output}", "--open-mode=append",
            f"--chdir={chdir}", "--nodes=1", "--ntasks=1", f"--cpus-per-task={nproc}"]
    if not _has_signal(options):
        argv.append(DEFAULT_SIGNAL)
    return [*argv, *options, str(script)]


def job_script(python: str, spec: Path, *, trial: str) -> str:
    """The batch script of one trial: one ``srun`` step (Slurm's ``scancel --signal`` and ``--signal``
    warnings reach a step's processes, not the batch shell) running :mod:`toolkit.run.slurm_job`.

    Example:
        >>> job_script("/venv/bin/python", Path("/o/t/slurm_trial.json"), trial="t").splitlines()[-1][:61]
        'exec srun --ntasks=1 --kill-on-bad-exit=1 /venv/bin/python -c'
    """
    command = shlex.join(["srun", "--ntasks=1", "--kill-on-bad-exit=1", python, "-c", _BOOT, str(spec)])
    return f"#!/bin/sh\n# {trial} of a search (written by python -m toolkit.run --slurm)\nexec {command}\n"


def squeue_argv() -> list[str]:
    """This user's jobs in every state still known (``JOBID|STATE`` lines)."""
    return ["squeue", "--noheader", "--me", "--states=all", "--format=%i|%T"]


def scancel_argv(job: str, *, signal_name: str | None = None) -> list[str]:
    """Cancel ``job``, or with ``signal_name`` (``USR1``) signal its steps' processes."""
    return ["scancel", *([f"--signal={signal_name}"] if signal_name else []), job]


def parse_squeue(text: str) -> dict[str, str]:
    """``squeue_argv``'s output as job id -> state.

    Example:
        >>> parse_squeue("12|RUNNING\\n13|COMPLETED\\n")
        {'12': 'RUNNING', '13': 'COMPLETED'}
    """
    jobs = {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        if job and state:
            jobs[job] = state.split()[0]
    return jobs
