"""Training and validation metrics, averaged across ranks and written by the chief to
TensorBoard and ``metrics.jsonl``; :class:`MetricsWriter` is the public entry (docs/training.md).

Example::

    # torchrun --nproc_per_node 2 train.py
    writer = MetricsWriter(ctx, "runs/exp")                          # call on all ranks
    writer.report_training_metrics(step, {"loss": loss}, samples=n)  # call on all ranks
"""

from toolkit.metrics.writer import MetricsSettings, MetricsWriter

__all__ = ["MetricsSettings", "MetricsWriter"]
