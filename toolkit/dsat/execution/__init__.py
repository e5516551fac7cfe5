"""Everything in dsat that spawns or kills: the trial runner and its settings, the launch argv
builders, host placement, process bookkeeping, and the classification of how a trial ended.
"""
