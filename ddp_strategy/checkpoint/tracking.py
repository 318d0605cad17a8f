"""Step 4 for the strategy: which checkpoints it wrote, the folders it will write to, and loading into the module.

:class:`CheckpointTracker` is the only thing :class:`~ddp_strategy.strategy.MyDDPStrategy` calls for checkpoint
bookkeeping; the file format is :class:`~ddp_strategy.checkpoint.plugin.DDPCheckpointIO`'s, the keys are
:mod:`~ddp_strategy.checkpoint.keys`'.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ddp_strategy._compat.namespace import TrainerFn, rank_zero_warn
from ddp_strategy.checkpoint.atomic import file_stamp, remove_stale_temp_files, unwritable_reason
from ddp_strategy.checkpoint.keys import FIT_MISMATCH_HINT, StateDictMismatchError, match_state_dict

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def _folders(trainer: Trainer) -> list[str | os.PathLike]:
    return [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]


class CheckpointTracker:
    """Remembers the checkpoint files this strategy wrote in this process (path, size and modification time)."""

    def __init__(self) -> None:
        self._written: dict[str, tuple[int, int]] = {}

    def record(self, path: Any) -> None:
        """Remember ``path`` as written here (after every rank knows the save succeeded)."""
        stamp = file_stamp(path)
        if stamp is not None:
            self._written[stamp[0]] = stamp[1]

    def forget(self, path: Any) -> None:
        """Forget ``path`` (it is being removed)."""
        stamp = file_stamp(path)
        if stamp is not None:
            self._written.pop(stamp[0], None)

    def weights_only_for(self, path: Any, weights_only: bool | None) -> bool | None:
        """``False`` for a file this strategy wrote and nobody changed since, when the caller did not choose.

        Lightning's internal restores (``Tuner.lr_find``'s temporary checkpoint, ``ckpt_path="best"``) cannot be
        given ``weights_only``; a file we wrote ourselves is trusted whatever it holds (an ``nn.Module`` among
        the hyper-parameters; Lightning's ddp fails there with a raw unpickling error). Otherwise ``weights_only``
        is returned unchanged (``None`` = :class:`~ddp_strategy.checkpoint.plugin.DDPCheckpointIO`'s default).
        """
        stamp = file_stamp(path)
        if weights_only is None and stamp is not None and self._written.get(stamp[0]) == stamp[1]:
            return False
        return weights_only

    @staticmethod
    def warn_if_unwritable(trainer: Trainer) -> None:
        """Before the first step (call on global rank 0): warn at once if a ``ModelCheckpoint`` folder is unwritable.

        A warning, not an error: Lightning's ``ddp`` runs such a fit and fails only at the first save, and a fit
        that never saves there succeeds; the warning names the folder long before that save would fail.
        """
        problem = unwritable_reason(_folders(trainer))
        if problem:
            rank_zero_warn(f"{problem} The first checkpoint saved there will fail; fix the folder now.")

    @staticmethod
    def remove_stale_temp_files(trainer: Trainer) -> None:
        """Remove temporary files that killed checkpoint writers left in the checkpoint folders (global rank 0)."""
        for folder in _folders(trainer):
            remove_stale_temp_files(folder)

    @staticmethod
    def load_into(module: Any, checkpoint: Mapping[str, Any], strict: bool, source: Any) -> None:
        """Load ``checkpoint["state_dict"]`` into the LightningModule ``module``, its keys renamed to the module's.

        Raises:
            StateDictMismatchError: ``strict`` (``LightningModule.strict_loading``) and keys are missing or
                unexpected; raised on every rank, since every rank loads the same file. In a fit the message adds
                how to start from the matching weights (the file's optimizer state needs exactly its parameters).
        """
        try:
            state_dict = match_state_dict(checkpoint["state_dict"], module, strict=strict, source=source)
        except StateDictMismatchError as e:
            if not _fitting(module):
                raise
            # strict_loading=False would pass here, but fit(ckpt_path=...) then restores the optimizer.
            raise StateDictMismatchError(f"{e}\n{FIT_MISMATCH_HINT}", e.missing, e.unexpected,
                                         e.mismatched_shapes) from None
        module.load_state_dict(state_dict, strict=strict)


def _fitting(module: Any) -> bool:
    """Whether the LightningModule's trainer is fitting (the strategy's own trainer is set only later, in its
    ``setup``, after Lightning restored a ``ckpt_path``)."""
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a trainer
        return False
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING
