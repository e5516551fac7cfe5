"""A directory for ``PYTHONPATH`` holding a ``determined`` package with ``determined.launch.wrap_rank`` only.

``python -m toolkit.run`` puts this directory on the entrypoint's ``PYTHONPATH`` when no real
``determined`` package is installed, so that a script which starts its workers with
``python3 -m determined.launch.wrap_rank RANK -- ...`` (Determined's ``4_distributed.py``)
runs unchanged. See :mod:`toolkit.compat.determined.wrap_rank`.
"""
