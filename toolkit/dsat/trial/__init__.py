"""What runs inside the user's process when dsat starts it as a trial: the reporting context, the
step timing and result, the out-of-memory handling. Imported by the core library; never imports the
tuner. Inside a trial, importing it answers py-cpuinfo from the runner's measurement; outside, nothing.
"""

from toolkit.dsat.trial.cpu_info import install_from_env
from toolkit.dsat.trial.reporting import dsat_reporting_context

install_from_env()  # inside a trial only: no interpreter per op load to measure the clock

__all__ = ["dsat_reporting_context"]
