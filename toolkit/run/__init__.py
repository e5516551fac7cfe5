"""``python -m toolkit.run CONFIG MODEL_DIR [--output-dir DIR]``: run an experiment on this machine.

The local counterpart of Determined's ``det experiment create CONFIG MODEL_DIR``: the
experiment's ``entrypoint`` runs in ``MODEL_DIR`` on ``resources.slots_per_trial`` processes,
started by torchrun (plain commands, ``determined.launch.torch_distributed``) or by DeepSpeed's
launcher (``determined.launch.deepspeed``; ``--no_local_rank``, as Determined passes it). Each
process gets ``TOOLKIT_EXPERIMENT_CONFIG`` (the YAML) and ``TOOLKIT_OUTPUT_DIR`` (checkpoints,
TensorBoard, metrics; default ``runs/<name>``), which ``det.get_cluster_info()``,
``toolkit.get_hparams()`` and ``toolkit.get_output_dir()`` read. Plain toolkit scripts run too.

* SIGTERM, SIGINT and SIGUSR1 (Slurm's ``--signal=B:USR1@N``) to this process are passed to the
  ranks, which stop through preemption (``should_preempt()``) and save; after ``--grace``
  seconds whatever is left is killed.
* A run that fails is started again, up to ``max_restarts`` times (Determined's default 5); it
  resumes from ``latest_checkpoint``. A run stopped by a forwarded signal is not restarted.
* Exit status: the last run's (0 when it succeeded). Bad input exits 2, naming the key or flag,
  with nothing started. No process of the run outlives this one.
* Hyperparameter search spaces are sampled once per output directory, as Determined's master
  samples them (``searcher: single`` too), and recorded there: every rank, restart and rerun
  sees the same values (:func:`toolkit.compat.determined.info.record_hparams`).
* An entrypoint without a launcher wrapper runs on ``slots_per_trial`` ranks, each one
  Determined container of one slot, so a script that launches its own workers
  (``python3 -m determined.launch.wrap_rank``, provided by a shim directory on ``PYTHONPATH``
  when the real package is absent) starts one worker per rank (:mod:`toolkit.run.process`).
* ``searcher: random / grid / adaptive_asha`` runs the search's trials several at once on the
  free slots of this machine (``searcher.max_concurrent_trials``, ``--max-slots``: see
  :mod:`toolkit.run.scheduler`), each in ``<output_dir>/trial-NNNN`` with its own trial id;
  ``<output_dir>/search.json`` holds each trial's values, seed, state and metric and the best;
  the same command again continues the search (a changed searcher section, search space or
  experiment seed exits 2: use a new ``--output-dir``). ASHA (asynchronous, Determined's brackets
  by ``mode``) stops a trial through the preemption signal
  (:mod:`toolkit.compat.determined.search`). A signal pauses every trial in flight and starts
  nothing more.

Modules: :mod:`~toolkit.run.plan` (pure decisions), :mod:`~toolkit.run.process` (one run's
processes and signals), :mod:`~toolkit.run.trial` (one trial's runs and restarts),
:mod:`~toolkit.run.search` (a search's records), :mod:`~toolkit.run.scheduler` (its trials in
flight on the slots), :mod:`~toolkit.run.cli` (the command line).

Example::

    python -m toolkit.run examples/determined/deepspeed.yaml examples/determined --output-dir runs/det
    # the same command again resumes from the latest checkpoint
"""

from toolkit.run.cli import main
from toolkit.run.plan import RunPlan, plan_run
from toolkit.run.trial import execute

__all__ = ["RunPlan", "execute", "main", "plan_run"]
