"""Step 4, checkpoints: keys without ``module.``, atomic writes, safe loads, conversion to plain PyTorch.

Owns: the model keys a checkpoint holds (:mod:`~ddp_strategy.checkpoint.keys`); crash-safe writes, safe loads and
Lightning's checkpoint plugin :class:`DDPCheckpointIO` (:mod:`~ddp_strategy.checkpoint.io`); conversion to and
from plain PyTorch files (:mod:`~ddp_strategy.checkpoint.convert`). Rank-agnostic: the strategy decides which
rank writes. Must not touch: the process group, loaders (sampler positions arrive inside the checkpoint dict).
"""

from ddp_strategy.checkpoint.convert import export_weights, import_plain_checkpoint, load_plain_state_dict
from ddp_strategy.checkpoint.io import (
    DamagedCheckpointError,
    DDPCheckpointIO,
    UnsafeCheckpointError,
    WrittenFiles,
    prepare_folders,
    remove_stale_temp_files,
)
from ddp_strategy.checkpoint.keys import (
    FIT_MISMATCH_HINT,
    StateDictMismatchError,
    match_state_dict,
    strip_ddp_prefix,
    unwrapped_state_dict,
)

__all__ = [
    "FIT_MISMATCH_HINT",
    "DDPCheckpointIO",
    "DamagedCheckpointError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
    "WrittenFiles",
    "export_weights",
    "import_plain_checkpoint",
    "load_plain_state_dict",
    "match_state_dict",
    "prepare_folders",
    "remove_stale_temp_files",
    "strip_ddp_prefix",
    "unwrapped_state_dict",
]
