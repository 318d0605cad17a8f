"""Step 4, checkpoints: keys without ``module.``, atomic writes, safe loads, conversion to plain PyTorch.

Owns: the model keys a checkpoint holds (:mod:`~ddp_strategy.checkpoint.keys`), crash-safe writes
(:mod:`~ddp_strategy.checkpoint.atomic`), safe and clearly failing loads (:mod:`~ddp_strategy.checkpoint.files`),
Lightning's checkpoint plugin (:mod:`~ddp_strategy.checkpoint.plugin`), conversion to and from plain PyTorch
files (:mod:`~ddp_strategy.checkpoint.convert`) and the strategy's bookkeeping
(:mod:`~ddp_strategy.checkpoint.tracking`). Rank-agnostic: the strategy decides which rank writes. Must not touch:
the process group, loaders (sampler positions arrive inside the checkpoint dict). Entry points:
:class:`DDPCheckpointIO` and :class:`CheckpointTracker`.
"""

from ddp_strategy.checkpoint.convert import export_weights, import_plain_checkpoint
from ddp_strategy.checkpoint.files import DamagedCheckpointError, UnsafeCheckpointError, load_plain_state_dict
from ddp_strategy.checkpoint.keys import (
           StateDictMismatchError,
           match_state_dict,
           strip_ddp_prefix,
           unwrapped_state_dict,
)
from ddp_strategy.checkpoint.plugin import DDPCheckpointIO, DefaultCheckpointIO
from ddp_strategy.checkpoint.tracking import CheckpointTracker

__all__ = ["CheckpointTracker", "DDPCheckpointIO", "DamagedCheckpointError", "DefaultCheckpointIO",
           "StateDictMismatchError", "UnsafeCheckpointError", "export_weights", "import_plain_checkpoint",
           "load_plain_state_dict", "match_state_dict", "strip_ddp_prefix", "unwrapped_state_dict"]
