"""toolkit's stand-in for the ``determined`` package: only ``determined.launch.wrap_rank`` exists.

Put on ``PYTHONPATH`` by ``python -m toolkit.run`` when the real package is not installed. A
script that still says ``import determined as det`` gets an error naming the import to use.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"determined.{name}: this 'determined' is toolkit's shim, which provides only "
        "'python3 -m determined.launch.wrap_rank'; in the script, write "
        "'from toolkit.compat import determined as det' instead of 'import determined as det'"
    )
