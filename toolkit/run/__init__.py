"""``python -m toolkit.run CONFIG MODEL_DIR [--output-dir DIR]``: Determined's ``det experiment create`` here.

Runs the experiment's entrypoint on ``resources.slots_per_trial`` ranks, or a search's trials
several at once (or as Slurm jobs with ``--slurm``). For users: docs/determined.md; inside:
docs/design-determined.md.

Example::

    python -m toolkit.run 3_hpsearch.yaml . --max-slots 2     # again: resumes from the checkpoints
"""

from toolkit.run.cli import main
from toolkit.run.plan import RunPlan, plan_run
from toolkit.run.trial import execute

__all__ = ["RunPlan", "execute", "main", "plan_run"]
