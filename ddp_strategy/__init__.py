"""ddp_strategy: synchronous data-parallel training for PyTorch Lightning that you can trust.

    from ddp_strategy import MyDDPStrategy
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())
"""

from ddp_strategy.checkpoint_io import DDPCheckpointIO, load_plain_state_dict, strip_ddp_prefix
from ddp_strategy.data import DigitsDataModule
from ddp_strategy.model import DigitsClassifier, DigitsNet
from ddp_strategy.sampler import EpochSeededDistributedSampler, shard_iterable
from ddp_strategy.strategy import MyDDPStrategy

__version__ = "0.1.0"

__all__ = [
    "DDPCheckpointIO",
    "DigitsClassifier",
    "DigitsDataModule",
    "DigitsNet",
    "EpochSeededDistributedSampler",
    "MyDDPStrategy",
    "load_plain_state_dict",
    "shard_iterable",
    "strip_ddp_prefix",
]
