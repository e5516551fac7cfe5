"""``python -m toolkit.dsat ARGS`` with every host taken as another machine (for tests/cluster).

On a one-host test cluster the allocation's only node is this machine, and dsat starts a trial
whose hosts are all this machine locally (torchrun, no srun). Here ``is_local_host`` says no for
every host, so trials take the multi-host path (srun inside an allocation) as they do from a
login node; nothing else changes.
"""
import runpy
import sys

from toolkit.launch import slots

slots.is_local_host = lambda name, **_: False
sys.argv[0] = "python -m toolkit.dsat"
runpy.run_module("toolkit.dsat", run_name="__main__", alter_sys=True)
