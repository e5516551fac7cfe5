"""What runs inside the user's process when dsat starts it as a trial. Imported by the core
library (``toolkit.dsat_reporting_context``); never imports the tuner. Outside a trial it changes
nothing on import; inside one, importing it answers py-cpuinfo from the runner's measurement.

* :mod:`~toolkit.dsat.trial.reporting`: the reporting context, the one dsat line of a loop;
* :mod:`~toolkit.dsat.trial.session`: times the steps, writes the result, ends the trial;
* :mod:`~toolkit.dsat.trial.profiling`: what the profiling trial measures in its first step;
* :mod:`~toolkit.dsat.trial.oom`: an out-of-memory error in a step ends the trial as ``"oom"``
  (an uncaught one is reported by :mod:`toolkit.runtime.trial_oom`'s excepthook);
* :mod:`~toolkit.dsat.trial.cpu_info`: py-cpuinfo's answer, measured once per dsat run.
"""

from toolkit.dsat.trial.cpu_info import install_from_env
from toolkit.dsat.trial.reporting import dsat_reporting_context

install_from_env()  # inside a trial only: no interpreter per op load to measure the clock

__all__ = ["dsat_reporting_context"]
