"""Which loader gets which sampler, bad-input checks, and evaluation loaders with equal batch counts.

:class:`LoaderSharding` is what the strategy calls for every loader a ``*_dataloader`` hook returns. Training
loaders are padded (every rank takes as many steps) and resume from the checkpoint's sampler position. Validation
and test loaders hold each sample once, batched so every rank takes the ``ceil(ceil(N / W) / B)`` steps Lightning's
padded sampler gives, so per-step collectives meet (``self.log(..., on_step=True, sync_dist=True)``); where no
such layout exists they are padded as under Lightning's ddp, with a warning. Where batch counts may still differ
(the user's own distributed sampler, an ``IterableDataset``, predict), :meth:`LoaderSharding.agree_counts` says so
at the stage's start (no collective in sharding), and the stage runs under the uneven-inputs join
(``sampling.uneven``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from contextlib import ExitStack, suppress
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import RunningStage, TrainerFn, rank_zero_warn, sized_len
from ddp_strategy.sampling import sampler as samplers

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: Start of the warning :func:`warn_if_order_kept` gives (``warnings.filterwarnings("ignore", message=...)``).
ORDER_KEPT_WARNING = "MyDDPStrategy keeps the training loader's order"


class LoaderSharding:
    """Shards one strategy's loaders, keeping what lasts across stages: the saved positions.

    Args:
        exact_evaluation: validation/test loaders hold each sample once (True), or are padded as under ``ddp``.
    """

    def __init__(self, exact_evaluation: bool = True) -> None:
        self.exact_evaluation = exact_evaluation
        self.positions: list[dict[str, Any]] = []  #: from the checkpoint, for the training loaders built next
        self.until_teardown = ExitStack()  #: what lasts while a fit runs (see ``state.restore_batch_counter``)
        # self._injecting (whether the strategy injects samplers) is set by take_over, before any prepare
        #: the batch counts (None: unknown) of the evaluation loaders whose counts need the peers', until teardown
        self._pending: list[int | None] = []

    def take_over(self, trainer: Trainer) -> None:
        """Turn Lightning's sampler injection off (kept for predict); ``use_distributed_sampler=False`` is honoured."""
        self._injecting = _pl.set_lightning_sampler_injection(trainer, enabled=trainer.state.fn == TrainerFn.PREDICTING)

    def hand_back(self, trainer: Trainer | None) -> None:
        """At teardown: give Lightning its sampler injection back, forget unused positions."""
        if trainer is not None:
            _pl.set_lightning_sampler_injection(trainer, enabled=True)
        self.positions, self._pending = [], []
        self.until_teardown.close()

    def prepare(self, dataloader: object, trainer: Trainer, world_size: int, rank: int, seed: int) -> object:
        """Return ``dataloader`` sharded for ``rank`` of ``world_size`` in the trainer's current stage.

        Predict loaders are Lightning's; what cannot be sharded (a list of batches, an ``IterableDataset``) is read
        whole by every rank, as under ``ddp``, with a warning. No collective (see :meth:`agree_counts`).
        Raises ``ValueError`` as :func:`inject_distributed_sampler` and where a saved position does not fit the loader.
        """
        if self._injecting:
            warn_if_not_shardable(dataloader, world_size)
        ours = self._injecting and trainer.state.fn != TrainerFn.PREDICTING
        # the epoch Lightning's fit loop runs, read as its on_run_start will have set it (a loader's workers draw
        # before): under max_steps, current_epoch (it finishes a saved epoch it counted processed), else processed
        shard = samplers.Shard(
            world_size,
            rank,
            seed,
            epoch_fn=lambda: (
                trainer.current_epoch if trainer.max_steps != -1 else trainer.fit_loop.epoch_progress.current.processed
            ),
        )
        if trainer.state.stage != RunningStage.TRAINING:
            stage = "test" if trainer.state.stage == RunningStage.TESTING else "validation"
            loader = shard_for_evaluation(dataloader, shard, stage, self.exact_evaluation) if ours else dataloader
            unknown = isinstance(getattr(loader, "dataset", None), IterableDataset)  # (its length is only a hint)
            self._pending += [None if unknown else sized_len(loader)] if injected_sampler(loader) is None else []
            return loader
        if not ours:
            return dataloader
        facts = _read(dataloader)  # read once, for the warning and the injection
        warn_if_order_kept(facts or dataloader, world_size, trainer.overfit_batches)
        loader = inject_distributed_sampler(facts or dataloader, shard)
        # one position per training loader, in order; one not ours (your DistributedSampler) restarts its epoch,
        # as under Lightning's ddp, whose "not resumable" warning says so
        position = self.positions.pop(0) if self.positions else None
        if position is not None and (injected := injected_sampler(loader)) is not None:
            injected.resume_from(position)
        return loader

    def agree_counts(self) -> bool:
        """At an evaluation stage's start, every rank: whether the batch counts of the loaders :meth:`prepare` left
        (the user's distributed sampler, an ``IterableDataset``, predict) differ between ranks or are unknown (no
        ``__len__``, or an ``IterableDataset``'s, which is only a hint): one ``all_gather_object``; none, and False,
        if it left none (the strategy's own shards hold as many batches on every rank). The counts :meth:`prepare`
        took stay until teardown: a fit's sanity check and every validation run after it use the loaders prepared
        once, and each run agrees anew (until 2026-12-06 only the first did: the later runs of uneven loaders ran
        without the join, and a per-step collective met another rank's epoch-end one, found by a fresh-user tryout);
        loaders reloaded every n epochs add theirs (a run stays under the join once an earlier set differed)."""
        world = dist.get_world_size() if self._pending and dist.is_available() and dist.is_initialized() else 1
        gathered = [list(self._pending)] * world
        if world > 1:
            dist.all_gather_object(gathered, gathered[0])
        return len({tuple(counts) for counts in gathered}) > 1 or any(None in counts for counts in gathered)


def flat_loaders(collection: object) -> list[Any]:
    """The loaders in one of Lightning's loader collections (``trainer.train_dataloader``, ``val_dataloaders``, ...):
    a loader, or lists, tuples and dicts of them, nested, in the order of ``CombinedLoader.flattened``
    (``dataloader_idx``). ``[loader]`` for one loader (also for ``None``), ``[]`` for an empty collection."""
    found: list[Any] = []
    apply_to_collection(collection, object, found.append, wrong_dtype=(list, tuple, Mapping))
    return found


@dataclasses.dataclass(frozen=True)
class _Loader:
    """A user's ``DataLoader`` that needs a distributed sampler, and what the injection reads off it, once.

    ``source`` is the sampler of indices behind it, also inside a batch sampler with ``batch_size`` and ``drop_last``
    (Lightning re-creates those around a distributed one; the loader's own if it has no ``sampler``); ``None`` for a
    batch sampler without them, whose whole batches are sharded. ``n``: items per epoch (indices, or batches).
    """

    dataloader: DataLoader
    source: Any
    n: int


def _read(dataloader: object) -> _Loader | None:
    """``dataloader``'s facts (itself if already read), or ``None`` where it is left alone: not a ``DataLoader``, an
    ``IterableDataset``'s, or one whose (batch) sampler is already distributed (ours: injection happens once; the
    user's is respected)."""
    if isinstance(dataloader, _Loader):
        return dataloader
    batch_sampler: Any = getattr(dataloader, "batch_sampler", None)
    held = (getattr(dataloader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    if (
        not isinstance(dataloader, DataLoader)
        or isinstance(dataloader.dataset, IterableDataset)
        or any(hasattr(s, "num_replicas") and hasattr(s, "rank") for s in held)  # ours, or a DistributedSampler
    ):
        return None
    whole = batch_sampler is not None and not (
        hasattr(batch_sampler, "batch_size") and hasattr(batch_sampler, "drop_last")
    )
    source: Any = None if whole else getattr(batch_sampler, "sampler", dataloader.sampler)
    return _Loader(dataloader, source, len(source if source is not None else batch_sampler))


def _is_plain_permutation(sampler: Any) -> bool:
    """A ``RandomSampler`` as ``shuffle=True`` makes it: one permutation of the data set, no replacement."""
    return (
        isinstance(sampler, RandomSampler)
        and not sampler.replacement
        and getattr(sampler, "_num_samples", None) is None
    )


def injected_sampler(dataloader: object) -> samplers._EpochShards | None:
    """The sampler :func:`inject_distributed_sampler` put into ``dataloader`` (or its batch sampler), else ``None``."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    candidates = (batch_sampler, getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None))
    return next((c for c in candidates if isinstance(c, samplers._EpochShards)), None)


def _check_shard_sizes(loader: _Loader, shard: samplers.Shard, training: bool) -> None:
    """Raise (the same on every rank) where ``loader`` cannot be sharded; warn where Lightning's ddp runs it."""
    source, n, w = loader.source, loader.n, shard.num_replicas
    what = "samples" if source is not None else "batches"
    if 0 < n < w:  # empty: no rank reads anything, as under Lightning's ddp
        rank_zero_warn(
            f"The loader has fewer {what} ({n}) than ranks ({w}): the shards are padded with repeats (as Lightning's"
            f" DistributedSampler pads them), so some ranks read the same {what}. Use a data set with at least {w}"
            f" {what}, or fewer devices."
        )
    if source is None or n == 0 or (batch_sampler := cast(Any, loader.dataloader.batch_sampler)) is None:
        return
    batch_size, drop_last = int(batch_sampler.batch_size), bool(batch_sampler.drop_last)  # source: it has both
    smallest = math.ceil(n / w) if shard.pad else n // w
    if drop_last and smallest < batch_size:
        raise ValueError(
            f"drop_last=True with batch_size={batch_size}, but a rank's shard has only {smallest} sample(s) ({n} over"
            f" {w} ranks): that rank would get no batch at all. Lower batch_size to at most {smallest}, set"
            " drop_last=False, or use fewer devices."
        )
    if training and smallest < batch_size:
        rank_zero_warn(
            f"batch_size={batch_size} is per device, but each rank's training shard has only {smallest} sample(s)"
            f" ({n} over {w} ranks), so every step sees a short batch. Lower batch_size to at most {smallest}"
            f" (the global batch is batch_size x {w}), or use fewer devices."
        )


def inject_distributed_sampler(dataloader: object, shard: samplers.Shard, training: bool | None = None) -> object:
    """Return ``dataloader`` re-created around a distributed sampler for ``shard``, or unchanged if it needs none.

    ``shuffle=True/False`` loaders get an :class:`~ddp_strategy.sampling.sampler.EpochSeededDistributedSampler`,
    other samplers a ``ShardedSampler``; unpadded, plain batches come from an ``EqualCountBatchSampler``; the user's
    batch sampler class is re-created around it, else (Lightning cannot) a ``ShardedBatchSampler`` shards its
    batches whole. Re-created by Lightning's logic (subclass arguments kept); ``batch_size`` stays the per-device
    B: the global batch is ``B * W``.

    Args:
        dataloader: the user's loader; returned as it is if not a ``DataLoader``, an ``IterableDataset``'s, or
            one whose (batch) sampler is already distributed (ours: injection happens once; the user's is respected).
        shard: this rank's share; ``pad=False`` for exact evaluation.
        training: warn about batches larger than a shard; default ``shard.pad``.

    Raises:
        ValueError: ``drop_last=True`` with a shard smaller than one batch.
        MisconfigurationException: a ``DataLoader`` subclass whose ``__init__`` arguments Lightning cannot find.
    """
    loader = _read(dataloader)
    if loader is None:
        return dataloader
    _check_shard_sizes(loader, shard, shard.pad if training is None else training)
    source, dataloader, batch_sampler = loader.source, loader.dataloader, loader.dataloader.batch_sampler
    if source is not None:  # a sampler of indices: ours takes its place
        built: samplers._EpochShards = (
            samplers.EpochSeededDistributedSampler(
                dataloader.dataset,
                shard.num_replicas,
                shard.rank,
                shuffle=isinstance(source, RandomSampler),
                seed=shard.seed,
                epoch_fn=shard.epoch_fn,
                pad=shard.pad,
            )
            if _is_plain_permutation(source) or isinstance(source, SequentialSampler)
            else samplers.ShardedSampler(source, shard)
        )
        built.items_per_batch, built.drop_last_batch = (  # no batch sampler (batch_size=None): 1 and False
            int(getattr(batch_sampler, "batch_size", 1)),
            bool(getattr(batch_sampler, "drop_last", False)),
        )
        if batch_sampler is None or (
            type(batch_sampler) is BatchSampler and shard.pad and dataloader.batch_size is not None
        ):
            return _pl.update_dataloader(dataloader, built)  # Lightning re-creates DataLoader(batch_size=B, ...)
        if type(batch_sampler) is BatchSampler:  # DataLoader(batch_sampler=BatchSampler(s, B, drop_last)), or unpadded
            return _pl.update_dataloader_batch_sampler(
                dataloader,
                samplers.EqualCountBatchSampler(built, built.items_per_batch)
                if not shard.pad
                else BatchSampler(built, built.items_per_batch, built.drop_last_batch),
            )
        with suppress(TypeError):  # the user's class, re-created around ``built`` (Lightning's code)
            return _pl.update_dataloader(dataloader, built)
    # a batch sampler of its own batches, or one Lightning cannot re-create (an argument it does not know): whole
    return _pl.update_dataloader_batch_sampler(
        dataloader,
        samplers.ShardedBatchSampler(cast(Iterable[Any], batch_sampler), shard),  # whole: not None
    )


def needs_padding(dataloader: DataLoader | _Loader, num_replicas: int) -> str | None:
    """Why ``dataloader`` has no exact layout with equal batch counts (a phrase for the warning), or ``None``.

    One exists when N is a multiple of W, or when B >= 2, N >= W and the incomplete last batch is kept; whole custom
    batches always have one (``ShardedBatchSampler``); for the user's batch sampler class, see the counts.
    """
    loader = _read(dataloader)
    if loader is None or loader.source is None or loader.n % num_replicas == 0:
        return None
    batch_sampler = loader.dataloader.batch_sampler
    reasons = (  # the first that applies
        (batch_sampler is None, "the loader does not batch (batch_size=None)"),
        (
            bool(getattr(batch_sampler, "drop_last", False)),
            "the loader drops its incomplete last batch (drop_last=True)",
        ),
        (
            int(getattr(batch_sampler, "batch_size", 1)) < 2,
            "batch_size=1 leaves a shorter rank no batch to make one sample smaller",
        ),
        (loader.n < num_replicas, f"there are fewer samples ({loader.n}) than ranks ({num_replicas})"),
    )
    return next((reason for applies, reason in reasons if applies), None)


def shard_for_evaluation(dataloader: object, shard: samplers.Shard, stage: str, exact: bool = True) -> object:
    """A validation (``stage="validation"``) or test loader with each sample once and equal batch counts, else
    (``exact=False``, ``drop_last=True``, or no such layout: :func:`needs_padding`, or uneven counts from the user's
    batch sampler class) padded as Lightning's ddp pads it, with a rank-0 warning where exactness is lost. No
    collective (:func:`count_batches` says how many batches each rank's shard makes)."""
    loader = _read(dataloader)
    if loader is None:
        return dataloader
    reason = needs_padding(loader, shard.num_replicas) if exact else None
    if exact and reason is None:  # drop_last=True (N a multiple of W here): Lightning's batches
        drops = bool(getattr(loader.dataloader.batch_sampler, "drop_last", False))
        exact_loader = cast(
            DataLoader, inject_distributed_sampler(loader, exact_shard := dataclasses.replace(shard, pad=drops))
        )
        if len(set(counts := count_batches(loader, exact_loader, exact_shard))) == 1:
            return exact_loader
        reason = f"its {type(exact_loader.batch_sampler).__name__} makes {list(counts)} batches of the exact shards"
    if reason is not None:
        n, w = loader.n, shard.num_replicas
        rank_zero_warn(
            f"The {stage} loader has {n} samples for {w} ranks and {reason}, so the ranks cannot hold the"
            f" same number of batches with every sample exactly once. Like Lightning's ddp, its shards are"
            f" padded: {-n % w} sample(s) are evaluated twice, and {stage} metrics count them twice. For"
            f" exact metrics use batch_size >= 2 and drop_last=False with at least {w} samples, or a data"
            f" set whose size is a multiple of {w}."
        )
    return inject_distributed_sampler(loader, dataclasses.replace(shard, pad=True), training=False)


def count_batches(dataloader: _Loader, loader: DataLoader, shard: samplers.Shard) -> tuple[int, ...]:
    """``(batches on rank 0, ..., rank W-1)`` of ``loader`` (``dataloader`` injected for ``shard``), without a
    collective: our batch samplers make as many on every rank; the user's class is re-created per rank."""
    ours = (BatchSampler, samplers.EqualCountBatchSampler, samplers.ShardedBatchSampler, type(None))
    return (
        (len(loader),) * shard.num_replicas
        if type(loader.batch_sampler) in ours
        else tuple(
            len(
                cast(
                    DataLoader,
                    inject_distributed_sampler(dataloader, dataclasses.replace(shard, rank=r), training=False),
                )
            )
            for r in range(shard.num_replicas)
        )
    )


def warn_if_order_kept(dataloader: object, world_size: int, overfit_batches: int | float = 0) -> None:
    """Warn once (rank 0) when the training batches differ from Lightning's ``ddp`` because the order is kept.

    Lightning's ``ddp`` shuffles every training loader it shards (but under ``overfit_batches``); we shuffle only a
    loader built with ``shuffle=True`` (the same shards as Lightning's) and keep any other's order.
    """
    loader = _read(dataloader)
    if overfit_batches or loader is None or _is_plain_permutation(loader.source):
        return
    source, batch_sampler = loader.source, loader.dataloader.batch_sampler
    custom = type(batch_sampler) not in (BatchSampler, type(None))  # the user's batch sampler, read in its order
    read = f"batch sampler is a {type(batch_sampler).__name__}" if custom else f"sampler is a {type(source).__name__}"
    shards = (
        f"rank r of {world_size} reads positions r, r + {world_size}, r + {2 * world_size}, ..."
        if world_size > 1
        else "the one process reads every position"
    )
    # Lightning re-creates your batch sampler around a shuffling DistributedSampler of the data set
    advice = (
        "For Lightning's batches and weights pass shuffle=True to the training DataLoader, or build your batch"
        " sampler on a RandomSampler"
        if source is not None and (custom or isinstance(source, SequentialSampler))
        else "MyDDPStrategy has no setting that gives Lightning's batches here"
    )
    rank_zero_warn(
        f"{ORDER_KEPT_WARNING}: its {read}, drawn once per epoch (the same draw on every rank) and read in its order:"
        f" {shards}. Lightning's strategy='ddp' shuffles every training loader (its DistributedSampler, or"
        " DistributedSamplerWrapper around your sampler, has shuffle=True), so the batches each rank reads, and the"
        f" trained weights, differ from a run with strategy='ddp'. {advice}; if the order is intended, silence this"
        f" with warnings.filterwarnings('ignore', message=\"{ORDER_KEPT_WARNING}\")."
    )


def warn_if_not_shardable(dataloader: object, world_size: int) -> None:
    """Warn once (rank 0), for W > 1, when ``dataloader`` has no indices to shard, so each rank reads what it yields.

    Lightning accepts any iterable (``trainer.test(model, [batch])``, an ``IterableDataset``); as under its ``ddp``,
    every rank iterates all of it. An ``IterableDataset`` may split its stream by rank in ``__iter__`` (litdata's
    ``StreamingDataset``, WebDataset's ``split_by_node``, :func:`~ddp_strategy.sampling.sampler.shard_iterable`),
    which only it knows: its warning says the ranks read the same data unless it does. An empty list (Lightning's
    "no loader") is not warned about.
    """
    iterable = isinstance(getattr(dataloader, "dataset", None), IterableDataset)
    empty = isinstance(dataloader, (list, tuple)) and not dataloader
    if world_size == 1 or empty or (isinstance(dataloader, DataLoader) and not iterable):
        return
    rank_zero_warn(
        f"{type(dataloader.dataset).__name__} is an IterableDataset, which has no indices to shard: each of the"
        f" {world_size} ranks reads what its __iter__ yields there (as under Lightning's ddp). Unless __iter__"
        " splits the data by rank itself (torch.distributed.get_rank(), as ddp_strategy.shard_iterable, litdata's"
        " StreamingDataset, WebDataset's split_by_node and Hugging Face's split_dataset_by_node do), every rank"
        " sees the same batches."
        if iterable
        else f"MyDDPStrategy got a {type(dataloader).__name__} as a loader, not a torch.utils.data.DataLoader: it"
        f" has no indices to shard, so each of the {world_size} ranks iterates all of it (as under Lightning's ddp)"
        " and sees the same batches. Wrap the data in a Dataset and a DataLoader to have it sharded."
    )
