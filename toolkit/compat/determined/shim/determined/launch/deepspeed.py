"""``python3 -m determined.launch.deepspeed CMD...`` inside a rank's script.

See :mod:`determined.launch._in_rank` (toolkit's shim).
"""

import sys

from ._in_rank import main

if __name__ == "__main__":
    sys.exit(main("determined.launch.deepspeed", sys.argv[1:]))
