"""Starting a job's processes on this machine, shared by dsat's trial runner and ``python -m
toolkit.run``: the argv of torchrun or DeepSpeed's launcher for an entrypoint, Determined's
launcher wrappers in an entrypoint, and the bookkeeping that finds and kills every process of a
job. Imports only the core library (neither dsat nor toolkit.run nor compat).

Example::

    from toolkit.launch.argv import build_trial_argv
    argv = build_trial_argv(["python3", "train.py"], launcher="torchrun", nproc=2, master_port=29511)
"""
