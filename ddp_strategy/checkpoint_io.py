"""Checkpoint IO: model state dicts without DDP's ``module.`` prefix, on save and on load.

``DistributedDataParallel.state_dict()`` names every key ``module.<name>``; a checkpoint saved that way
does not load into the plain model (``load_state_dict`` reports every key missing). Lightning's own
checkpoints are taken from the unwrapped LightningModule, but hand-written DDP scripts and wrapped
sub-modules produce prefixed keys. This module normalises keys in both directions and gives one function
that brings a checkpoint's weights into the plain ``nn.Module``. All functions are rank-agnostic; the
strategy makes only global rank 0 write.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

#: The key prefix ``DistributedDataParallel`` adds to its module's state dict.
DDP_PREFIX = "module."


def strip_ddp_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove a leading ``module.`` from every key when all keys carry it, as a DDP wrapper's do.

    A state dict where only some keys start with ``module.`` comes from a model with a real sub-module
    called ``module``; it is returned unchanged.

    Args:
        state_dict: parameter and buffer name -> tensor.

    Returns:
        A new dict with the same values, in the same order.

    Example:
        >>> strip_ddp_prefix({"module.fc.weight": 1, "module.fc.bias": 2})
        {'fc.weight': 1, 'fc.bias': 2}
    """
    if state_dict and all(key.startswith(DDP_PREFIX) for key in state_dict):
        return {key[len(DDP_PREFIX):]: value for key, value in state_dict.items()}
    return dict(state_dict)


def normalize_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Return ``checkpoint`` with its ``"state_dict"`` entry (if any) passed through :func:`strip_ddp_prefix`.

    Args:
        checkpoint: a Lightning checkpoint dict, or any dict.

    Returns:
        A shallow copy; other entries are the same objects.
    """
    if isinstance(checkpoint.get("state_dict"), Mapping):
        return {**checkpoint, "state_dict": strip_ddp_prefix(checkpoint["state_dict"])}
    return checkpoint


def load_file(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load`` a checkpoint file, with errors that name the file.

    Args:
        path: the file.
        map_location: as for :func:`torch.load`; default ``"cpu"``.
        weights_only: refuse to unpickle arbitrary objects (default True: an untrusted file cannot run code).

    Returns:
        What the file holds.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is truncated or not a PyTorch checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        if weights_only and "weights_only" in str(e) and "Unsupported" in str(e):
            raise
        raise ValueError(
            f"Checkpoint file {path} is damaged or is not a PyTorch checkpoint ({type(e).__name__}: {e})."
            " Use an earlier checkpoint or re-save this one."
        ) from e


def load_plain_state_dict(path: str | os.PathLike, submodule: str = "model") -> dict[str, torch.Tensor]:
    """Load the weights of one sub-module from a checkpoint, ready for the plain ``nn.Module``.

    Works for Lightning checkpoints (weights under ``"state_dict"``), plain PyTorch files holding a
    ``"model_state_dict"`` or ``"model"`` entry, and bare state dicts, with or without DDP's
    ``module.`` prefix. Loads with ``torch.load(weights_only=True)``; needs no Lightning at the call site
    beyond this package.

    Args:
        path: checkpoint file.
        submodule: attribute name of the plain model inside the LightningModule (``"model"`` for
            :class:`~ddp_strategy.model.DigitsClassifier`); ``""`` returns the whole state dict.

    Returns:
        Parameter and buffer name -> tensor, keys without ``module.`` or ``<submodule>.``.

    Raises:
        FileNotFoundError, ValueError: see :func:`load_file`.
        KeyError: no key starts with ``<submodule>.``; the message lists a few of the keys found.
    """
    checkpoint = load_file(path)
    state_dict: Mapping[str, Any] = checkpoint
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get(key), Mapping):
            state_dict = checkpoint[key]
            break
    state_dict = strip_ddp_prefix(state_dict)
    if not submodule:
        return dict(state_dict)
    prefix = submodule + "."
    picked = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not picked:
        raise KeyError(
            f"No key in {os.fspath(path)} starts with {prefix!r}; found e.g. {list(state_dict)[:5]}."
            " Pass submodule='' for the whole state dict, or the attribute name of your model."
        )
    return picked


def unwritable_reason(folders: list[str | os.PathLike]) -> str | None:
    """Check that checkpoints can be written to each folder; say why not for the first that fails.

    Creates missing folders (as ``ModelCheckpoint`` would) and writes and removes a small probe file.
    Local paths only; remote (``scheme://``) paths are skipped.

    Args:
        folders: checkpoint folders.

    Returns:
        ``None`` when all are writable, else a message naming the folder and the error.
    """
    for folder in folders:
        folder = os.fspath(folder)
        if "://" in folder:
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            probe = os.path.join(folder, f".ddp_strategy_write_test_{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as e:
            return (f"Checkpoint folder {folder} is not writable ({type(e).__name__}: {e.strerror or e}). Choose a"
                    " writable ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) before training.")
    return None


class DDPCheckpointIO(TorchCheckpointIO):
    """Lightning's :class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO`, with DDP-safe keys.

    ``save_checkpoint`` writes ``checkpoint["state_dict"]`` without a ``module.`` prefix;
    ``load_checkpoint`` accepts files whose keys carry it. Everything else (file format, remote paths
    through fsspec) is Lightning's. Rank-agnostic: the strategy calls ``save_checkpoint`` on global rank 0
    only.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path`` with normalised model keys (see :func:`normalize_checkpoint`)."""
        super().save_checkpoint(normalize_checkpoint(checkpoint), path, storage_options=storage_options)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable | Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint and strip a ``module.`` prefix from its model keys.

        Raises:
            FileNotFoundError: ``path`` does not exist (Lightning's message).
        """
        return normalize_checkpoint(super().load_checkpoint(path, map_location=map_location,
                                                            weights_only=weights_only))
