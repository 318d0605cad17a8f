"""ddp_strategy: synchronous data-parallel training for PyTorch Lightning that you can trust.

    from ddp_strategy import MyDDPStrategy
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())
    trainer = pytorch_lightning.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())  # the same

Works with either Lightning namespace (``lightning`` or ``pytorch_lightning``), see
:mod:`ddp_strategy._compat.namespace`.
"""

from ddp_strategy._compat import moved as _moved
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

#: Module paths of the flat layout (0.1) -> the modules their code lives in now (see ddp_strategy._compat.moved):
#: old imports (``from ddp_strategy.comm_hooks import bf16_all_reduce_hook``), configs and pickles keep working.
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "argument_checks": ("options",), "checkpoint_convert": ("checkpoint.convert",),
    "checkpoint_io": ("checkpoint.keys", "checkpoint.files", "checkpoint.atomic", "checkpoint.plugin",
                      "checkpoint.tracking"),
    "comm_hooks": ("sync.comm_hooks",), "data": ("reference.data",), "demo": ("reference.demo",),
    "evaluation": ("sampling.evaluation",), "failures": ("process.failures", "process.boundaries"),
    "gather": ("process.collectives",), "injection": ("sampling.injection",), "launching": ("process.launching",),
    "model": ("reference.model",), "process_group": ("process.group", "process.rendezvous"),
    "rank_check": ("sync.rank_check",), "resume": ("sampling.resume",), "sampler": ("sampling.sampler",),
    "sampler_state": ("sampling.state",), "sync_batchnorm": ("sync.sync_batchnorm",),
    "wrapping": ("sync.wrapping", "process.group"), "_namespace": ("_compat.namespace",),
    "_lightning_private": ("_compat.lightning_private",), "_torch_private": ("_compat.torch_private",),
}
_moved.install(__name__, MOVED_MODULES, renamed={"wrapping": {"ddp_device_ids": "device_ids"}})

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
