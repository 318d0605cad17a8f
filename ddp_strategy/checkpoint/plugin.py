"""``DDPCheckpointIO``: Lightning's checkpoint plugin, writing atomically and loading safely."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.checkpoint.atomic import atomic_save, is_local
from ddp_strategy.checkpoint.files import LOAD_OPT_OUT, DamagedCheckpointError, load_file
from ddp_strategy.checkpoint.keys import normalize_checkpoint

if TYPE_CHECKING:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    TorchCheckpointIO = _namespace.lightning_base("fabric.plugins.io.torch_io:TorchCheckpointIO")


class DDPCheckpointIO(TorchCheckpointIO):
    """Lightning's :class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO`, crash-safe and safe to load.

    ``save_checkpoint`` writes local files with :func:`atomic_save` and model keys without ``_orig_mod.``;
    ``load_checkpoint`` loads with ``weights_only=True`` unless told otherwise and reports damaged files
    clearly (:func:`load_file`). Remote paths (fsspec URLs) are Lightning's. Rank-agnostic: the strategy
    calls ``save_checkpoint`` on global rank 0 only.

    Args:
        weights_only: what ``load_checkpoint(weights_only=None)`` uses (default True). An explicit
            ``Trainer.fit(ckpt_path=..., weights_only=False)`` still opts out for one load.
        verify_checksums: check the CRC-32 of every zip member before loading (default True; see
            :func:`load_file`): costs about one extra read of the file, catches flipped bits in tensor data.

    Raises:
        TypeError: ``weights_only`` or ``verify_checksums`` is not a bool.
    """

    def __init__(self, weights_only: bool = True, verify_checksums: bool = True) -> None:
        super().__init__()
        if weights_only is not None and not isinstance(weights_only, bool):  # None: torch.load's default
            raise TypeError(f"DDPCheckpointIO(weights_only=...) must be True or False, got {weights_only!r}.")
        if not isinstance(verify_checksums, bool):
            raise TypeError(f"DDPCheckpointIO(verify_checksums=...) must be True or False, got {verify_checksums!r}.")
        self.weights_only = weights_only
        self.verify_checksums = verify_checksums

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path`` atomically (see :func:`atomic_save`).

        Raises:
            TypeError: ``storage_options`` is given (not supported by this plugin, as in Lightning's).
        """
        checkpoint = normalize_checkpoint(checkpoint)
        if not is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support storage_options; got {storage_options!r}.")
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable | Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint; ``weights_only=None`` means this plugin's default (True).

        Local files: whatever the file holds, the result is a checkpoint dict or one of the errors below.

        Raises:
            FileNotFoundError, PermissionError, DamagedCheckpointError, UnsafeCheckpointError: see
                :func:`load_file`; ``DamagedCheckpointError`` also when the file holds something other than a
                dict (a list, a tensor, ...), which no Lightning checkpoint is.
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        if not is_local(path):
            return _pl.load_checkpoint_with_weights_only(super().load_checkpoint, path, map_location, weights_only)
        checkpoint = load_file(path, map_location=map_location, weights_only=weights_only,
                               verify_checksums=self.verify_checksums, opt_out=LOAD_OPT_OUT)
        if not isinstance(checkpoint, dict):
            raise DamagedCheckpointError(f"Checkpoint file {os.fspath(path)} holds a {type(checkpoint).__name__},"
                                         " not a checkpoint dict; it was not written by Trainer.save_checkpoint."
                                         " Pass the .ckpt file Lightning saved.")
        return checkpoint


class DefaultCheckpointIO:
    """Strategy mixin: the ``checkpoint_io`` property defaults to :class:`DDPCheckpointIO` (Lightning's
    ``Strategy`` defaults to ``TorchCheckpointIO``); a plugin the user passes is used as given."""

    _checkpoint_io: Any

    @property
    def checkpoint_io(self) -> Any:
        """The checkpoint plugin; :class:`DDPCheckpointIO` unless the user passed another."""
        if self._checkpoint_io is None:
            self._checkpoint_io = DDPCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io
