"""Step 3, gradient synchronisation: DDP wrapping and its options, comm hooks, SyncBatchNorm, rank checks.

Owns: wrapping the LightningModule in ``DistributedDataParallel``, unwrapping it and the checks around it
(:mod:`~ddp_strategy.sync.wrapping`), communication hooks and counting their bytes
(:mod:`~ddp_strategy.sync.comm_hooks`), SyncBatchNorm that also works on CPU
(:mod:`~ddp_strategy.sync.sync_batchnorm`) and the parameter checksum check (:mod:`~ddp_strategy.sync.rank_check`).
Must not touch: loaders, checkpoints, the process group's lifetime. The strategy's hooks call these directly.
"""

from ddp_strategy.sync.comm_hooks import (
    CommHook,
    CommHookConfig,
    bf16_all_reduce_hook,
    count_collective_bytes,
    model_averager,
)
from ddp_strategy.sync.rank_check import verify_parameters_in_sync
from ddp_strategy.sync.sync_batchnorm import CPUSyncBatchNorm, cpu_capable
from ddp_strategy.sync.wrapping import (
    DDPForwardRedirection,
    after_backward,
    broadcast_states,
    ddp_options,
    unwrap,
    wrap,
)

__all__ = [
    "CPUSyncBatchNorm",
    "CommHook",
    "CommHookConfig",
    "DDPForwardRedirection",
    "after_backward",
    "bf16_all_reduce_hook",
    "broadcast_states",
    "count_collective_bytes",
    "cpu_capable",
    "ddp_options",
    "model_averager",
    "unwrap",
    "verify_parameters_in_sync",
    "wrap",
]
