"""Checkpoints of the reference loop: written atomically, validated on load.

A checkpoint is written to a temporary file in the same folder and renamed over the target, so a
crash mid-write leaves the previous checkpoint intact. Loading checks the format marker and the
keys, and turns a missing or unreadable file into a clear error.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

FORMAT = "daca-kernels-checkpoint/1"


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    """Write ``state`` (a dict of tensors, numbers, strings, lists and dicts) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | os.PathLike, required: tuple[str, ...] = ()) -> dict:
    """Read a checkpoint written by [`save_checkpoint`][integration.checkpoint.save_checkpoint].

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a readable checkpoint of this format, or lacks a ``required`` key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise ValueError(f"checkpoint {path} is corrupted or unreadable ({type(error).__name__}: {error})") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} is not a {FORMAT} file")
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(missing)}")
    return state
