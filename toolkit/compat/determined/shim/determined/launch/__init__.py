"""Determined's launchers: ``wrap_rank``, and ``torch_distributed`` / ``deepspeed`` called by a script.

As the entrypoint's first command, ``torch_distributed`` and ``deepspeed`` are unwrapped by
toolkit.run; called from a script the entrypoint runs (``bash launch.sh``), they run the command
as the calling rank's worker (:mod:`._in_rank`).
"""
