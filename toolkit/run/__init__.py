"""``python -m toolkit.run CONFIG MODEL_DIR [--output-dir DIR]``: run an experiment on this machine.

The local counterpart of Determined's ``det experiment create CONFIG MODEL_DIR``: the
experiment's ``entrypoint`` runs on ``resources.slots_per_trial`` processes (torchrun, or
DeepSpeed's launcher for ``determined.launch.deepspeed``), with ``TOOLKIT_EXPERIMENT_CONFIG`` and
``TOOLKIT_OUTPUT_DIR`` set for every rank. A signal to this process stops the ranks through
``should_preempt()``; a failed run restarts up to ``max_restarts`` times from its latest
checkpoint; the same command again continues. A search (``random``, ``grid``,
``adaptive_asha``) runs its trials several at once on this machine's free slots, or as Slurm
jobs with ``--slurm "SBATCH OPTIONS"``. Bad input exits 2, naming the key or flag, with nothing
started. How each piece works: docs/determined.md and docs/multi-node.md.

Example::

    python -m toolkit.run examples/determined/deepspeed.yaml examples/determined --output-dir runs/det
    python -m toolkit.run 3_hpsearch.yaml . --max-slots 2          # a search, 2 trials at once
    # the same command again resumes from the latest checkpoint
"""

from toolkit.run.cli import main
from toolkit.run.plan import RunPlan, plan_run
from toolkit.run.trial import execute

__all__ = ["RunPlan", "execute", "main", "plan_run"]
