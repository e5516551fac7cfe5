"""Compatibility layers for training scripts written against other tools' APIs.

``toolkit.compat.determined`` runs Determined AI Core API scripts (``det.core.init()``,
``core_context.train / checkpoint / preempt / searcher / distributed``) on toolkit's own helpers,
with only the import lines changed::

    from toolkit.compat import determined as det          # was: import determined as det
    from toolkit.compat.determined.pytorch import dsat    # was: from determined.pytorch import dsat
"""
