"""Step 2, the sampler: which samples each rank reads, each epoch, and where a resumed epoch continues.

Owns: the distributed samplers (:mod:`~ddp_strategy.sampling.sampler`), their positions for mid-epoch resume
(:mod:`~ddp_strategy.sampling.state`, :mod:`~ddp_strategy.sampling.resume`), putting them into the user's
loaders (:mod:`~ddp_strategy.sampling.injection`) and exact evaluation shards
(:mod:`~ddp_strategy.sampling.evaluation`). Must not touch: the process group's lifetime, the model,
checkpoint files (positions go into the checkpoint dict the strategy hands over). Entry point:
:class:`LoaderSharding`.
"""

from ddp_strategy.sampling.sampler import EpochSeededDistributedSampler, shard_iterable, shared_seed
from ddp_strategy.sampling.sharding import LoaderSharding

__all__ = ["EpochSeededDistributedSampler", "LoaderSharding", "shard_iterable", "shared_seed"]
