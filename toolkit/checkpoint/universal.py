"""Which DeepSpeed universal checkpoint (``ds_to_universal`` output) to load. Any rank.

:func:`toolkit.load_checkpoint` loads one when the DeepSpeed config sets
``"checkpoint": {"load_universal": true}``; this module finds it and refuses a folder that is not one.

Example::

    # torchrun --nproc_per_node 4 train.py   (the chief decides, inside load_checkpoint)
    tag = universal_tag("checkpoints", None)   # what latest_universal names
"""

from __future__ import annotations

from pathlib import Path

from toolkit.checkpoint.records import read_pointer
from toolkit.errors import CheckpointError

__all__ = ["universal_tag"]


def universal_tag(root: str, tag: str | None) -> str:
    """The universal checkpoint to load: ``tag``, or the one ``latest_universal`` names. Any rank.

    Raises:
        CheckpointError: no tag and no ``latest_universal``, or the folder is not a universal
            checkpoint (the message gives the ``ds_to_universal`` command).
    """
    chosen = tag
    if chosen is None:
        latest = Path(root) / "latest_universal"
        pointed, problem = read_pointer(root, "latest_universal")
        if pointed is None:
            raise CheckpointError(f"checkpoint.load_universal is set but no tag was given and "
                                  f"{problem or f'{latest} does not exist'}; pass the tag of the "
                                  "ds_to_universal output folder")
        chosen = pointed
    folder = Path(root) / chosen
    if not (folder / "zero").is_dir():
        raise CheckpointError(
            f"checkpoint.load_universal is set but {folder} is not a universal checkpoint "
            f"(no zero/ folder); make one with `python -m deepspeed.checkpoint.ds_to_universal "
            f"--input_folder {folder} --output_folder {folder}_universal --inject_missing_state`")
    return chosen
