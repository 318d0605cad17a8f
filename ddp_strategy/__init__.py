"""ddp_strategy: synchronous data-parallel training for PyTorch Lightning that you can trust.

    from ddp_strategy import MyDDPStrategy
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())
    trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())  # the same

Works with either Lightning namespace (``lightning`` or ``pytorch_lightning``), see
:mod:`ddp_strategy._compat.namespace`.
"""

import importlib as _importlib
import sys as _sys

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
from ddp_strategy.sampling import EpochSeededDistributedSampler, shard_iterable
from ddp_strategy.strategy import MyDDPStrategy
from ddp_strategy.sync import CPUSyncBatchNorm, bf16_all_reduce_hook, count_collective_bytes

#: Module paths of releases before the sub-packages (0.1.0's flat layout) -> where that code lives now. Old
#: imports (``from ddp_strategy.comm_hooks import bf16_all_reduce_hook``) and configs naming them keep working.
MOVED_MODULES = {
    "argument_checks": "options", "checkpoint_convert": "checkpoint.convert", "checkpoint_io": "checkpoint",
    "comm_hooks": "sync.comm_hooks", "data": "reference.data", "demo": "reference.demo",
    "evaluation": "sampling.evaluation", "failures": "process.failures", "gather": "process.collectives",
    "injection": "sampling.injection", "launching": "process.launching", "model": "reference.model",
    "process_group": "process.group", "rank_check": "sync.rank_check", "resume": "sampling.resume",
    "sampler": "sampling.sampler", "sampler_state": "sampling.state", "sync_batchnorm": "sync.sync_batchnorm",
    "wrapping": "sync.wrapping", "_namespace": "_compat.namespace", "_lightning_private": "_compat.lightning_private",
    "_torch_private": "_compat.torch_private",
}
for _old, _new in MOVED_MODULES.items():
    _sys.modules.setdefault(f"{__name__}.{_old}", _importlib.import_module(f"{__name__}.{_new}"))

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
