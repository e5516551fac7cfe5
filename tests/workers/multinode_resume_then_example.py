"""The resume launch of tests/runtime/test_multinode.py: multinode_train.py's run (its resume), then,
in the same processes, examples/core_api/train.py as it is, so that one two-node launch checks both.

    torchrun --nnodes 2 ... multinode_resume_then_example.py OUT CKPT --max-steps N -- EXAMPLE_ARGS...

Each script runs as ``python script.py`` would run it (runpy, ``__name__ == "__main__"``, its own
directory first on sys.path, its own arguments). The example's ``toolkit.init_distributed()`` finds
the process group of the first one and returns the same context, as a second call does.
"""
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "core_api" / "train.py"


def run_script(script: Path, args: list[str]) -> None:
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


split = sys.argv.index("--")
own, example_args = sys.argv[1:split], sys.argv[split + 1:]
run_script(HERE / "multinode_train.py", own)
run_script(EXAMPLE, example_args)
