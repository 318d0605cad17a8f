"""``MyDDPStrategy(...)``'s arguments, checked in its ``__init__`` (on every rank, before any process starts).

Only arguments Lightning's ``DDPStrategy`` does not have are refused when mistyped (``seed``, ``init_method``,
``store``, ...). The DDP options Lightning passes to ``DistributedDataParallel`` unchecked keep Lightning's
behaviour: a non-bool flag is accepted with a warning (DDP reads it as true or false), and only a value DDP
itself would crash on later, in every rank, is refused now (``bucket_cap_mb="25"``).
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_strategy import process, sync
from ddp_strategy._compat.namespace import rank_zero_warn

#: Lightning's ``seed_everything`` accepts 0 .. 2**32 - 1 (NumPy's range); the sampler seeds with seed + epoch.
_MAX_SEED = 2**32 - 1 - 1000


@dataclass(frozen=True)
class StrategyOptions:
    """The strategy's arguments the strategy reads after checking (see :class:`~ddp_strategy.MyDDPStrategy`)."""

    timeout: timedelta
    start_method: process.StartMethod
    seed: int | None
    allow_cpu_oversubscription: bool
    barrier_timeout: timedelta
    checkpoint_on_sigterm: bool | str | os.PathLike
    ddp_kwargs: dict[str, Any]
    comm_hook: sync.CommHookConfig
    model_averaging_period: int | None
    verify_sync_every_n_steps: int | None

    def sigterm_save(self, trainer: Any) -> functools.partial | None:
        """The save on SIGTERM, ``trainer.save_checkpoint`` with its path (the given one, ``<default_root_dir>/
        sigterm.ckpt`` for True) bound (``.args[0]``); None without ``checkpoint_on_sigterm`` or a trainer."""
        if self.checkpoint_on_sigterm and trainer is not None:  # (an empty path was refused: strategy_options)
            path = (
                self.checkpoint_on_sigterm
                if isinstance(self.checkpoint_on_sigterm, (str, os.PathLike))
                else os.path.join(trainer.default_root_dir, "sigterm.ckpt")
            )
            return functools.partial(trainer.save_checkpoint, os.fspath(path))
        return None


def strategy_options(
    *,
    process_group_backend: Any,
    timeout: Any,
    start_method: Any,
    seed: Any,
    init_method: Any,
    store: Any,
    allow_cpu_oversubscription: Any,
    monitored_barrier_timeout: Any,
    checkpoint_on_sigterm: Any,
    ddp_comm_hook: Any,
    ddp_comm_state: Any,
    ddp_comm_wrapper: Any,
    model_averaging_period: Any,
    verify_sync_every_n_steps: Any,
    divide_by_initial_world_size: Any,
    find_unused_parameters: Any,
    static_graph: Any,
    gradient_as_bucket_view: Any,
    bucket_cap_mb: Any,
    broadcast_buffers: Any,
    ddp_kwargs: dict[str, Any],
) -> StrategyOptions:
    """Check every argument of ``MyDDPStrategy(...)``, naming the bad one, and return :class:`StrategyOptions`.

    ``start_method=None`` becomes :func:`ddp_strategy.process.default_start_method`; seconds become ``timedelta``;
    ``monitored_barrier_timeout=None`` becomes ``timeout``; DDP options equal to DDP's defaults are dropped.

    Raises:
        TypeError: a wrong type (``seed="1"``, ``init_method=5``), an unknown DDP option or comm hook.
        ValueError: out of range (``verify_sync_every_n_steps=0``, ``checkpoint_on_sigterm=""``, a ``seed`` outside 0 ..
            2**32 - 1001, a non-positive timeout), an unknown ``start_method`` or ``init_method`` scheme, and ``store``
            with ``start_method="spawn"``/``"forkserver"`` (a store cannot be pickled to the new processes). An
            unknown ``process_group_backend`` is refused at the join, as under Lightning (a backend registered later
            works).
    """
    none = type(None)
    for name, value, expected, types in (
        ("process_group_backend", process_group_backend, "a string or None", (str, none)),
        ("start_method", start_method, "a string or None", (str, none)),
        ("init_method", init_method, "a string or None", (str, none)),
        ("seed", seed, "an int or None", (numbers.Integral, none)),
        ("store", store, "a torch.distributed.Store (e.g. FileStore) or None", (dist.Store, none)),
        ("allow_cpu_oversubscription", allow_cpu_oversubscription, "True or False", (bool,)),
        ("divide_by_initial_world_size", divide_by_initial_world_size, "True or False", (bool,)),
        ("checkpoint_on_sigterm", checkpoint_on_sigterm, "True, False or a file path", (bool, str, os.PathLike)),
        ("verify_sync_every_n_steps", verify_sync_every_n_steps, "an int or None", (numbers.Integral, none)),
        ("bucket_cap_mb", bucket_cap_mb, "a number of MiB or None", (numbers.Real, none)),
        ("model_averaging_period", model_averaging_period, "an int or None", (numbers.Integral, none)),
    ):
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):  # bool: an Integral
            raise TypeError(f"MyDDPStrategy({name}=...) must be {expected}, got {value!r} ({type(value).__name__}).")
    if seed is not None and not 0 <= seed <= _MAX_SEED:
        raise ValueError(
            f"MyDDPStrategy(seed={seed}): the sampler seed must be between 0 and {_MAX_SEED}"
            f" (Lightning's seed_everything range, 0 to 2**32 - 1, less room for the epoch); pass a"
            f" smaller seed, or None to use seed_everything's."
        )
    if isinstance(checkpoint_on_sigterm, (str, os.PathLike)) and not os.fspath(checkpoint_on_sigterm):
        raise ValueError(
            "MyDDPStrategy(checkpoint_on_sigterm='') is an empty path; pass a file path, True for"
            " <default_root_dir>/sigterm.ckpt, or False."
        )
    if verify_sync_every_n_steps is not None and verify_sync_every_n_steps < 1:
        raise ValueError(
            "verify_sync_every_n_steps must be a positive number of optimizer steps or None, got"
            f" {verify_sync_every_n_steps}."
        )
    flags = {
        "find_unused_parameters": find_unused_parameters,
        "static_graph": static_graph,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "broadcast_buffers": broadcast_buffers,
    }
    for name, value in flags.items():
        if not isinstance(value, (bool, numbers.Integral)):
            rank_zero_warn(
                f"MyDDPStrategy({name}={value!r}) is not True or False; DistributedDataParallel will"
                f" treat it as {bool(value)}. Pass True or False."
            )
    if start_method is not None and start_method not in process.START_METHODS:
        raise ValueError(f"Unknown start_method={start_method!r}; use one of {list(process.START_METHODS)} or None.")
    process.validate_init_method(init_method)
    start_method = start_method or process.default_start_method()
    if store is not None and start_method in ("spawn", "forkserver"):
        raise ValueError(
            f"store= cannot be used with start_method={start_method!r}: a Store cannot be pickled to"
            " the new processes. Use start_method='fork' or 'popen' (with a FileStore path every"
            " process opens), or init_method='file:///path' instead."
        )
    return StrategyOptions(
        process.as_timedelta(timeout),
        start_method,
        seed,
        allow_cpu_oversubscription,
        process.as_timedelta(timeout if monitored_barrier_timeout is None else monitored_barrier_timeout),
        checkpoint_on_sigterm,
        sync.ddp_options({**flags, "bucket_cap_mb": bucket_cap_mb}, ddp_kwargs),
        sync.CommHookConfig(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper),
        model_averaging_period,
        verify_sync_every_n_steps,
    )


#: ``MyDDPStrategy``'s own arguments (not Lightning's ``ParallelStrategy``'s): :func:`strategy_options`'s
#: keyword arguments other than ``ddp_kwargs``.
STRATEGY_ARGUMENTS: tuple[str, ...] = tuple(
    name for name in inspect.signature(strategy_options).parameters if name != "ddp_kwargs"
)
