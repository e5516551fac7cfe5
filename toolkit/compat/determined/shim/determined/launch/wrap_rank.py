"""``python3 -m determined.launch.wrap_rank``: runs :mod:`toolkit.compat.determined.wrap_rank`."""

import sys

from toolkit.compat.determined.wrap_rank import main

if __name__ == "__main__":
    sys.exit(main())
