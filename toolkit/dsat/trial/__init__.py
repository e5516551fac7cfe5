"""What runs inside the user's process when dsat starts it as a trial: the reporting context (the
one dsat line of a loop), the step timing and result, and the out-of-memory handling. Imported by
the core library (``toolkit.dsat_reporting_context``); never imports the tuner. Outside a trial it
changes nothing on import; inside one, importing it answers py-cpuinfo from the runner's
measurement.
"""

from toolkit.dsat.trial.cpu_info import install_from_env
from toolkit.dsat.trial.reporting import dsat_reporting_context

install_from_env()  # inside a trial only: no interpreter per op load to measure the clock

__all__ = ["dsat_reporting_context"]
