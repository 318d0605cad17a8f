"""Step 3, gradient synchronisation: DDP wrapping and its options, comm hooks, SyncBatchNorm, rank checks.

Owns: wrapping the LightningModule in ``DistributedDataParallel`` and unwrapping it
(:mod:`~ddp_strategy.sync.wrapping`), communication hooks (:mod:`~ddp_strategy.sync.comm_hooks`), SyncBatchNorm
that also works on CPU (:mod:`~ddp_strategy.sync.sync_batchnorm`) and the parameter checksum check
(:mod:`~ddp_strategy.sync.rank_check`). Must not touch: loaders, checkpoints, the process group's lifetime.
Entry point: :class:`GradientSync`.
"""

from ddp_strategy.sync.comm_hooks import CommHook, CommHookConfig, bf16_all_reduce_hook, count_collective_bytes
from ddp_strategy.sync.gradient_sync import GradientSync
from ddp_strategy.sync.sync_batchnorm import CPUSyncBatchNorm
from ddp_strategy.sync.wrapping import DDPForwardRedirection, non_default_options, unwrap_module, validate_ddp_kwargs

__all__ = ["CPUSyncBatchNorm", "CommHook", "CommHookConfig", "DDPForwardRedirection", "GradientSync",
           "bf16_all_reduce_hook", "count_collective_bytes", "non_default_options", "unwrap_module",
           "validate_ddp_kwargs"]
