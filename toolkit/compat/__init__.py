"""Compatibility layers for training scripts written against other tools' APIs: ``toolkit.compat.determined``
runs Determined AI Core API scripts on toolkit's helpers, with only the import lines changed."""
