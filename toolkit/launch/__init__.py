"""Starting a job's processes on this machine, for dsat's trial runner and ``python -m toolkit.run``:
launcher argv, Determined's wrappers, output, slots, and finding and killing every process of a job.
Imports only the core library. Design: docs/design-dsat-runner.md#launching-a-job-on-this-machine.
"""
