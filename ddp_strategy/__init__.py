"""ddp_strategy: synchronous data-parallel training for PyTorch Lightning that you can trust.

    from ddp_strategy import MyDDPStrategy
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())
    trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())  # the same

Works with either Lightning namespace (``lightning`` or ``pytorch_lightning``): see
:mod:`ddp_strategy._compat.namespace`.
"""

from ddp_strategy.checkpoint import (
    DamagedCheckpointError,
    DDPCheckpointIO,
    StateDictMismatchError,
    UnsafeCheckpointError,
    export_weights,
    import_plain_checkpoint,
    load_plain_state_dict,
    match_state_dict,
    strip_ddp_prefix,
    unwrapped_state_dict,
)
from ddp_strategy.process import all_gather_rows
from ddp_strategy.reference import DigitsClassifier, DigitsDataModule, DigitsNet
from ddp_strategy.sampling import EpochSeededDistributedSampler, UnevenInputsError, shard_iterable
from ddp_strategy.strategy import MyDDPStrategy
from ddp_strategy.sync import CPUSyncBatchNorm, bf16_all_reduce_hook, count_collective_bytes

__version__ = "0.2.0"

__all__ = [
    "CPUSyncBatchNorm",
    "DDPCheckpointIO",
    "DamagedCheckpointError",
    "DigitsClassifier",
    "DigitsDataModule",
    "DigitsNet",
    "EpochSeededDistributedSampler",
    "MyDDPStrategy",
    "StateDictMismatchError",
    "UnevenInputsError",
    "UnsafeCheckpointError",
    "all_gather_rows",
    "bf16_all_reduce_hook",
    "count_collective_bytes",
    "export_weights",
    "import_plain_checkpoint",
    "load_plain_state_dict",
    "match_state_dict",
    "shard_iterable",
    "strip_ddp_prefix",
    "unwrapped_state_dict",
]
