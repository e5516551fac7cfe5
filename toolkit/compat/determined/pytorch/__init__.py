"""``determined.pytorch``: only ``dsat`` is provided (``from toolkit.compat.determined.pytorch import dsat``).

Determined's Trial API (PyTorchTrial, DeepSpeedTrial, the Trainer) is not: port such trials to a
Core API script.
"""
