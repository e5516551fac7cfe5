"""toolkit's stand-in for the ``determined`` package: only the ``determined.launch`` wrappers exist.

Put on ``PYTHONPATH`` by ``python -m toolkit.run`` when the real package is not installed. A
script that still says ``import determined as det`` (then ``det.core``) or ``from determined
import core`` gets an ImportError naming the import to use. Any process.
"""

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "launch":  # ``from determined import launch``: the one submodule here
        return importlib.import_module(f"{__name__}.launch")
    if name.startswith("__") and name.endswith("__"):  # the import system's own probes
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise ImportError(
        f"determined.{name}: this 'determined' is toolkit's shim, which provides only "
        "'python3 -m determined.launch.wrap_rank' (and torch_distributed, deepspeed); swap the import to "
        "'from toolkit.compat import determined as det' (instead of 'import determined as det')",
        name=__name__,
    )
