"""Keys of Determined's experiment config that only its cluster used (Determined 0.38's reference),
each with why it is not honoured here: :func:`toolkit.config.experiment.warn_unknown_keys` says
so, once per key, instead of "unknown key". Pure data; any process."""

from __future__ import annotations

__all__ = ["NOT_HONOURED"]

_HERE = "toolkit runs the entrypoint on this machine, in this Python environment"
_SCHEDULER = ("Determined's scheduler placed trials on its agents and pools; here a trial runs on this "
              "machine's slots (python -m toolkit.run --max-slots N)")
_TRIAL_API = ("only Determined's Trial API read it (a Core API script {does} where it calls {call}, "
              "on Determined too)")

#: Section prefix (``""``: the top level, ``"resources."`` ...) -> key -> why it is not honoured here.
NOT_HONOURED: dict[str, dict[str, str]] = {
    "": {
        "bind_mounts": "Determined mounted these host paths into its containers; here the entrypoint reads "
                       "this machine's paths directly",
        "checkpoint_policy": _TRIAL_API.format(does="checkpoints", call="checkpoint.store_path"),
        "min_checkpoint_period": _TRIAL_API.format(does="checkpoints", call="checkpoint.store_path"),
        "min_validation_period": _TRIAL_API.format(does="validates",
                                                   call="train.report_validation_metrics"),
        "perform_initial_validation": _TRIAL_API.format(does="validates",
                                                        call="train.report_validation_metrics"),
        "scheduling_unit": _TRIAL_API.format(does="checks for preemption", call="preempt.should_preempt"),
        "optimizations": "Horovod and mixed-precision settings of Determined's Trial API; set them in the "
                         "DeepSpeed config",
        "data_layer": "the data layer of Determined's Trial API; read the data in the script",
        "profiling": "Determined's profiler sent system metrics to its master's web UI; use torch.profiler, "
                     "or DeepSpeed's flops_profiler / wall_clock_breakdown",
        "tensorboard_storage": "Determined's master uploaded TensorBoard files there; here they stay in "
                               "<output_dir>/tensorboard",
        "workspace": "Determined's master filed experiments by workspace; here the output directory does",
        "project": "Determined's master filed experiments by project; here the output directory does",
        "log_policies": "Determined's master matched log lines to retry or fail a trial; here a failed run "
                        "is restarted up to max_restarts times",
        "retention_policy": "Determined's master deleted task logs after log_retention_days; here the logs "
                            "stay where they are written",
        "integrations": "Determined's master posted to Pachyderm and webhooks",
        "security": "Kerberos settings of Determined's agents",
        "preemption_timeout": "Determined's master waited that long for a preempted trial; here use "
                              "python -m toolkit.run --grace SECONDS",
        "slurm": "options of Determined's HPC launcher; here use python -m toolkit.run --slurm "
                 "'SBATCH OPTIONS'",
        "pbs": "options of Determined's HPC launcher for PBS, which toolkit does not drive; for Slurm use "
               "python -m toolkit.run --slurm 'SBATCH OPTIONS'",
        "internal": "Determined's own settings",
    },
    "resources.": {
        **dict.fromkeys(("resource_pool", "agent_label", "priority", "weight", "is_single_node"), _SCHEDULER),
        "max_slots": "the experiment's cap of slots on Determined's cluster; here python -m toolkit.run "
                     "--max-slots N",
        "slots": "the slots of a Determined command or notebook; a trial uses resources.slots_per_trial",
        "devices": "Determined mounted these devices into its containers; " + _HERE,
        "shm_size": "the shared memory of Determined's container; here this machine's /dev/shm",
        "native_parallel": "a removed Determined setting",
    },
    "environment.": dict.fromkeys(("image", "pod_spec", "force_pull_image", "registry_auth",
                                   "add_capabilities", "drop_capabilities", "proxy_ports", "ports"), _HERE),
    "checkpoint_storage.": {
        "save_experiment_best": "each trial keeps its save_trial_latest newest and save_trial_best best "
                                "checkpoints, nothing is kept across trials",
        "propagation": "the storage path is used in place, no bind mount",
    },
    "searcher.": dict.fromkeys(("source_trial_id", "source_checkpoint_uuid"),
                               "Determined's master started every trial from that checkpoint's weights; load "
                               "it in the script instead (info.latest_checkpoint is this trial's own)"),
}

