"""``python -m toolkit.dsat {binary,random,asha} CONFIG MODEL_DIR [flags]``; see :mod:`toolkit.dsat.cli`."""

import sys

from toolkit.dsat.cli import main

if __name__ == "__main__":
    sys.exit(main())
