"""Consolidate a committed checkpoint into one plain fp32 ``state_dict`` file. Rank 0 only, or any
single process offline: no collectives, no process group."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from toolkit._files import atomic_write
from toolkit.checkpoint import layout
from toolkit.errors import CheckpointError, ConfigError

__all__ = ["consolidate_checkpoint"]

logger = logging.getLogger(__name__)


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike[str], output_path: str | os.PathLike[str], *,
                           tag: str | None = None) -> str:
    """Write a committed checkpoint's weights (``tag``; None: the latest) as one fp32 ``state_dict`` file.

    Rank 0 only, or one process offline. ZeRO 1-3 through DeepSpeed's ``zero_to_fp32`` (the fp32
    master weights), ZeRO-0 the module's weights, pipeline the layer files as keys
    ``<layer index>.<name>`` (what ``torch.nn.Sequential(*layers).load_state_dict`` expects); not tensor
    parallel. ``output_path`` is replaced atomically. Unpickles DeepSpeed's files: trusted ones only.

    Example (offline, or under ``if ctx.is_chief:`` in a job)::

        toolkit.consolidate_checkpoint("checkpoints", "model_fp32.pt")
        model.load_state_dict(torch.load("model_fp32.pt", weights_only=True))
    """
    root = layout.checkpoint_root(checkpoint_dir)
    problems = [None if tag is None else layout.name_problem(tag)]
    if not isinstance(output_path, (str, os.PathLike)) or not os.fspath(output_path):
        problems.append(f"output_path={output_path!r}: expected a file path")
    if any(problems):
        raise ConfigError([p for p in problems if p], source="consolidate_checkpoint()")
    output = Path(output_path)
    if output.is_dir():
        raise CheckpointError(f"output_path={str(output)!r} is a directory; expected a file path")
    info, warning = layout.resolve_tag(layout.scan_dir(root), tag)
    if warning:
        logger.warning("%s", warning)
    if info is None:
        raise CheckpointError(f"{root} holds no committed checkpoint to consolidate")
    state_dict = _fp32_state_dict(root, info)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(output, lambda fh: torch.save(state_dict, fh))
    logger.info("consolidated checkpoint %r of %s into %s (%d tensors)", info.tag, root, output,
                len(state_dict))
    return info.tag


def _fp32_state_dict(root: str, info: layout.TagInfo) -> dict[str, Any]:
    """The committed checkpoint's weights as fp32 tensors, keyed as the module names them."""
    meta, tag_dir = info.meta, Path(root) / info.tag
    if meta.get("tensor_parallel_size", 1) != 1:
        raise CheckpointError(f"checkpoint {info.tag!r} is tensor parallel "
                              f"(size {meta['tensor_parallel_size']}); consolidate it with DeepSpeed's "
                              "universal checkpoint tools instead")
    state_dict: dict[str, Any] = {}
    if meta.get("pipeline"):
        for path in sorted(tag_dir.glob("layer_*-model_states.pt")):
            index = int(path.name.split("-")[0][len("layer_"):])
            layer = torch.load(path, map_location="cpu", weights_only=True)
            state_dict.update({f"{index}.{name}": value for name, value in layer.items()})
    elif any(tag_dir.glob("*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state_dict = get_fp32_state_dict_from_zero_checkpoint(root, tag=info.tag)
    else:
        state_dict = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                                weights_only=False)["module"]
    return {name: value.detach().float().contiguous() if value.is_floating_point() else value
            for name, value in state_dict.items()}
