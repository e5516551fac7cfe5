"""Which DeepSpeed universal checkpoint (``ds_to_universal`` output) to load, for ``load_checkpoint``
under ``"checkpoint": {"load_universal": true}``; a folder that is not one is refused. Any rank."""

from __future__ import annotations

from pathlib import Path

from toolkit.checkpoint.records import read_pointer
from toolkit.errors import CheckpointError

__all__ = ["universal_tag"]


def universal_tag(root: str, tag: str | None) -> str:
    """The universal checkpoint to load: ``tag``, or the one ``latest_universal`` names; CheckpointError
    (with the ``ds_to_universal`` command) when there is none or the folder is not one. Any rank."""
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
