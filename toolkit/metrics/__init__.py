"""Training and validation metrics, averaged across ranks and written by the chief to TensorBoard and
``metrics.jsonl``; :class:`MetricsWriter` is the public entry (docs/training.md, Metrics)."""

from toolkit.metrics.writer import MetricsSettings, MetricsWriter

__all__ = ["MetricsSettings", "MetricsWriter"]
