"""``determined.pytorch``: only ``dsat`` and ``deepspeed.overwrite_deepspeed_config`` are provided
(``from toolkit.compat.determined.pytorch import dsat``, ``... import deepspeed``).

Determined's Trial API (PyTorchTrial, DeepSpeedTrial, the Trainer) is not: port such trials to a
Core API script.
"""
