"""Session fixtures for the tests with the real Slurm, Open MPI and pdsh (issue 16).

Where the test runs as root with apt-get, missing Debian packages (slurm-wlm, munge, openmpi-bin,
openssh-server, pdsh) are installed once; otherwise every test here skips with the reason. The
Slurm cluster (munged, slurmctld, slurmd) and the sshd start once per session, on loopback ports,
under a temporary directory, and stop at the session's end whatever the tests did; daemons that a
killed earlier session left are killed first (:func:`hostprocs.reap_orphans`).
"""

from __future__ import annotations

import logging
import os

import hostprocs
import pytest
import realcluster
import realsshd

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def cluster_packages():
    """Skips the test unless slurm, munge, Open MPI, sshd and pdsh are (or can be) installed."""
    reason = hostprocs.ensure_packages()
    if reason:
        pytest.skip(reason)
    killed = hostprocs.reap_orphans()
    if killed:
        logger.warning("killed %d daemon(s) left by an earlier test session: %s", len(killed), killed)


@pytest.fixture(scope="session")
def slurm(cluster_packages, tmp_path_factory):
    """A one-node Slurm cluster (this host's CPUs) for the session."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons need root (SlurmUser=root)")
    cluster = realcluster.start_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def sshd(cluster_packages, tmp_path_factory):
    """An sshd on a loopback port that root reaches without a password, through ``sshd.env()``."""
    if os.geteuid() != 0:
        pytest.skip("the test sshd logs in as root (its key is authorized for root only)")
    daemon = realsshd.start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(autouse=True)
def _no_stale_op_lock():
    """A rank killed while torch's loader held DeepSpeed's op lock would hang every later rank."""
    for lock in hostprocs.clear_stale_op_locks():
        logger.warning("removed a stale DeepSpeed op-build lock %s (no compiler running)", lock)
    yield
    for lock in hostprocs.clear_stale_op_locks():
        logger.warning("removed a stale DeepSpeed op-build lock %s (no compiler running)", lock)
