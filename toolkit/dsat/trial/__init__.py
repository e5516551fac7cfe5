"""What runs inside the user's process when dsat starts it as a trial: the reporting context
that times the steps and ends the trial, the profiling of the first step, and the out-of-memory
hook. Imported by the core library (``toolkit.dsat_reporting_context``); never imports the tuner.
"""

from toolkit.dsat.trial.reporting import dsat_reporting_context

__all__ = ["dsat_reporting_context"]
