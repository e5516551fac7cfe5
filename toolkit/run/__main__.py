"""``python -m toolkit.run CONFIG MODEL_DIR [--output-dir DIR]`` (see :mod:`toolkit.run`)."""

import sys

from toolkit.run.cli import main

sys.exit(main())
