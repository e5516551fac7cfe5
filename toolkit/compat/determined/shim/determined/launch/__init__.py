"""Determined's launchers: here only ``wrap_rank``.

``determined.launch.torch_distributed`` and ``deepspeed`` in an entrypoint are mapped by toolkit.run.
"""
