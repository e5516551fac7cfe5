"""``python -m toolkit.dsat {binary,random,asha} CONFIG MODEL_DIR [flags]``: :mod:`toolkit.dsat.tuner_cli`."""

import sys

from toolkit.dsat.tuner_cli import main

if __name__ == "__main__":
    sys.exit(main())
