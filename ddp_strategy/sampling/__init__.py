"""Step 2, the sampler: which samples each rank reads, each epoch, and where a resumed epoch continues.

Owns: the distributed samplers (:mod:`~ddp_strategy.sampling.sampler`), which loader gets which sampler and exact
evaluation shards (:mod:`~ddp_strategy.sampling.loaders`, entry point :class:`LoaderSharding`), sampler positions
in checkpoints and the mid-epoch resume (:mod:`~ddp_strategy.sampling.state`), training on ranks with different
numbers of batches (the policies, :mod:`~ddp_strategy.sampling.uneven`, :class:`UnevenInputs`, on the join of
:mod:`~ddp_strategy.sampling.join`). Must not touch: the process group's
lifetime, the model, checkpoint files (positions go into the checkpoint dict the strategy hands over).
"""

from ddp_strategy.sampling.loaders import LoaderSharding, flat_loaders
from ddp_strategy.sampling.sampler import EpochSeededDistributedSampler, Shard, shard_iterable, shared_seed
from ddp_strategy.sampling.state import read_positions, restore_batch_counter, save_positions
from ddp_strategy.sampling.uneven import UnevenInputs, UnevenInputsError

__all__ = [
    "EpochSeededDistributedSampler",
    "LoaderSharding",
    "Shard",
    "UnevenInputs",
    "UnevenInputsError",
    "flat_loaders",
    "read_positions",
    "restore_batch_counter",
    "save_positions",
    "shard_iterable",
    "shared_seed",
]
