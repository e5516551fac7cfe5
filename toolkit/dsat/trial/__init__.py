"""What runs inside the user's process when dsat starts it as a trial. Imported by the core
library (``toolkit.dsat_reporting_context``); never imports the tuner; changes nothing on import.

* :mod:`~toolkit.dsat.trial.reporting`: the reporting context, the one dsat line of a loop;
* :mod:`~toolkit.dsat.trial.session`: times the steps, writes the result, ends the trial;
* :mod:`~toolkit.dsat.trial.profiling`: what the profiling trial measures in its first step;
* :mod:`~toolkit.dsat.trial.oom`: an out-of-memory error in a step ends the trial as ``"oom"``
  (an uncaught one is reported by :mod:`toolkit.runtime.trial_oom`'s excepthook).
"""

from toolkit.dsat.trial.reporting import dsat_reporting_context

__all__ = ["dsat_reporting_context"]
