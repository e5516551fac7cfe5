"""The ``TOOLKIT_*`` environment variables that toolkit's launchers (dsat, ``python -m toolkit.run``)
set for the processes they start, and that the core library reads inside them.

The names live here, below ``config/`` and ``runtime/`` and the launchers, so that a training
script reads them without loading the tuner. Constants only; nothing runs on import.

``TOOLKIT_TRIAL_HPARAMS`` (:data:`TRIAL_HPARAMS_ENV`)
    JSON file with the trial's hyperparameters (read by :func:`toolkit.get_hparams`).
``TOOLKIT_EXPERIMENT_CONFIG`` (:data:`EXPERIMENT_CONFIG_ENV`)
    the experiment YAML.
``TOOLKIT_OUTPUT_DIR`` (:data:`OUTPUT_DIR_ENV`)
    where the run writes checkpoints and TensorBoard logs.
``TOOLKIT_DSAT_TRIAL`` (:data:`TRIAL_ENV`)
    JSON file describing a dsat trial (:class:`toolkit.dsat.contract.TrialContract`); also the
    mark by which a trial's processes are found.
``TOOLKIT_DSAT_RUN`` (:data:`RUN_ENV`)
    marks every process of a run that is not a trial, so that none outlives it.
``TOOLKIT_BUILD_GUARDS`` (:data:`BUILD_GUARDS_ENV`)
    "1": importing ``toolkit.compat.determined`` installs the op-build guards (``python -m toolkit.run``).

Example::

    path = os.environ.get(TRIAL_ENV)    # any rank: set only inside a dsat trial
"""

from __future__ import annotations

__all__ = ["BUILD_GUARDS_ENV", "EXPERIMENT_CONFIG_ENV", "OUTPUT_DIR_ENV", "RUN_ENV", "TRIAL_ENV",
           "TRIAL_HPARAMS_ENV"]

#: Path of a JSON file holding this trial's hyperparameters; set by the dsat trial runner.
TRIAL_HPARAMS_ENV = "TOOLKIT_TRIAL_HPARAMS"
#: Path of the experiment YAML; used by :func:`toolkit.get_hparams` when no path is passed.
EXPERIMENT_CONFIG_ENV = "TOOLKIT_EXPERIMENT_CONFIG"
#: Directory a run writes its checkpoints and TensorBoard logs to; set by dsat for each trial (its
#: own trial directory) and for the full experiment, so they never touch the user's own runs.
OUTPUT_DIR_ENV = "TOOLKIT_OUTPUT_DIR"
#: Environment variable naming the trial's :class:`~toolkit.dsat.contract.TrialContract` JSON file.
TRIAL_ENV = "TOOLKIT_DSAT_TRIAL"
#: Marks every process of one run that is not a trial (its value: the run's mark).
RUN_ENV = "TOOLKIT_DSAT_RUN"
#: "1" in the processes ``python -m toolkit.run`` starts: a Determined script may call
#: ``deepspeed.init_distributed()`` (which loads an op on CPU) before anything of toolkit's.
BUILD_GUARDS_ENV = "TOOLKIT_BUILD_GUARDS"
