"""Helpers shared by test files across directories, imported by name: ``from helpers import procutil``.

* ``procutil``: start real processes for tests (torchrun, the deepspeed launcher, plain python) with
  a clean environment and the suite's session mark; the paths of the repository and tests/workers.
* ``relutil``: the reliability suite's chaos campaigns on examples/core_api/train.py (start, signal,
  restart, compare the final weights with an uninterrupted run).
* ``resets``: forget what toolkit caches once per process (the cluster info, a dsat trial's session).

``tests/`` is on ``sys.path`` (pytest puts the directory of the top ``conftest.py`` there), so
``helpers`` is found from any test directory. Worker scripts under tests/workers run as separate
processes and do not import these modules. Helpers used by one directory only stay beside its
tests (tests/cluster/hostprocs.py, realcluster.py, realsshd.py; tests/dsat/search/searchsim.py).
"""
