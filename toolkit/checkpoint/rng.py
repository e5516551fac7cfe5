"""Capture and restore this process's random number generators, in a form safe to unpickle.

Python's ``random``, NumPy's global generator, torch's CPU generator and the CUDA ones, as tensors,
ints, floats and None only, so that ``torch.load(..., weights_only=True)`` reads them back.
``save_checkpoint`` stores one per rank; to keep the states outside a checkpoint, import the two
functions from here (any rank; each rank keeps its own streams)::

    torch.save(capture_rng_state(), f"rng_rank{ctx.rank}.pt")
    restore_rng_state(torch.load(f"rng_rank{ctx.rank}.pt", weights_only=True))
"""

from __future__ import annotations

import importlib
import logging
import pickle
import random
from pathlib import Path
from typing import Any, Mapping

import torch

from toolkit._files import atomic_write

np: Any = None
try:  # NumPy is optional for torch; DeepSpeed needs it, but this module must not.
    np = importlib.import_module("numpy")
except ImportError:  # pragma: no cover - numpy is installed wherever DeepSpeed is
    pass

__all__ = ["capture_rng_state", "read_rank_file", "restore_rng_state", "write_rank_file",
           "RNG_STATE_VERSION"]

logger = logging.getLogger(__name__)

RNG_STATE_VERSION = 1


def capture_rng_state() -> dict[str, Any]:
    """The state of this process's Python, NumPy, torch and CUDA generators, loadable with
    ``weights_only=True`` (``numpy``/``cuda`` None without them). Any rank."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "version": RNG_STATE_VERSION,
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": None,
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put this process's generators back to a :func:`capture_rng_state` state (CUDA's only when as many
    devices are visible, else a warning); ValueError for anything else. Any rank."""
    if not isinstance(state, Mapping) or state.get("version") != RNG_STATE_VERSION:
        version = state.get("version") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"RNG state version {version!r}: expected a dict from "
                         f"toolkit.checkpoint.rng.capture_rng_state() with version {RNG_STATE_VERSION}")
    missing = [key for key in ("python", "numpy", "torch", "cuda") if key not in state]
    if missing:
        raise ValueError(f"RNG state lacks {', '.join(missing)}: expected a dict from "
                         "toolkit.checkpoint.rng.capture_rng_state()")
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]))
    if state["numpy"] is not None:
        if np is None:
            logger.warning("the RNG state holds a NumPy state but NumPy is not installed; skipped")
        else:
            saved = state["numpy"]
            np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                                 saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if cuda is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning("the RNG state holds %d CUDA generator(s) but %d device(s) are visible; "
                           "CUDA random streams start fresh", len(cuda), visible)


def write_rank_file(path: Path, *, rank: int, world_size: int) -> None:
    """Write this rank's states to ``path`` atomically (OSError, or torch.save's RuntimeError). Any rank."""
    saved = {"rank": rank, "world_size": world_size, "rng": capture_rng_state()}
    atomic_write(path, lambda fh: torch.save(saved, fh))


def read_rank_file(path: Path, *, rank: int, world_size: int) -> tuple[Any, str | None]:
    """This rank's states from :func:`write_rank_file` (``weights_only=True``) and why they are unusable,
    or None; the caller makes the ranks agree on the errors. Any rank."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("rank") != rank or saved.get("world_size") != world_size:
            return None, (f"{path} holds rank {saved.get('rank')} of {saved.get('world_size')}, "
                          f"expected rank {rank} of {world_size}")
        return saved["rng"], None
    # An empty or foreign file raises EOFError or UnpicklingError: a problem like the others, so that
    # this rank reaches the agreement on them rather than leaving the others waiting in it.
    except (OSError, RuntimeError, KeyError, AttributeError, EOFError, pickle.UnpicklingError) as err:
        return None, f"cannot read this rank's RNG states {path}: {err}"
