"""``MyDDPStrategy(...)``'s arguments, checked in its ``__init__`` (before any process starts) and kept together.

:func:`strategy_options` turns the constructor's arguments into one :class:`StrategyOptions`, refusing bad
values early, on every rank (each rank constructs the strategy).

Only arguments Lightning's ``DDPStrategy`` does not have are refused when mistyped (``seed``,
``init_method``, ``store``, ...). The DDP options Lightning passes through to
``DistributedDataParallel`` unchecked keep Lightning's behaviour: a non-bool flag is accepted with a
warning (DDP reads it as true or false), and only a value DDP itself would crash on later, in every rank,
is refused now (``bucket_cap_mb="25"``).
"""

from __future__ import annotations

import inspect
import numbers
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_strategy import process, sync
from ddp_strategy._compat.namespace import rank_zero_warn

#: The boolean DDP options the strategy names (Lightning passes them to DDP as given).
DDP_FLAGS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers")

#: Lightning's ``seed_everything`` accepts 0 .. 2**32 - 1 (NumPy's range).
_MAX_SEED = 2**32 - 1


def _type_error(name: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"MyDDPStrategy({name}=...) must be {expected}, got {value!r} ({type(value).__name__}).")


def check_strategy_arguments(
    process_group_backend: Any,
    start_method: Any,
    seed: Any,
    init_method: Any,
    store: Any,
    allow_cpu_oversubscription: Any,
    checkpoint_on_sigterm: Any,
    verify_sync_every_n_steps: Any,
    bucket_cap_mb: Any,
    ddp_flags: dict[str, Any],
) -> None:
    """Refuse mistyped or out-of-range strategy arguments, naming the argument; warn on odd DDP flags.

    Raises:
        TypeError: an argument has the wrong type (e.g. ``seed="1"``, ``init_method=5``).
        ValueError: an argument is out of range (``verify_sync_every_n_steps=0``, ``checkpoint_on_sigterm=""``,
            a ``seed`` outside 0 .. 2**32 - 1001).
    """
    for name, value in (("process_group_backend", process_group_backend), ("start_method", start_method),
                        ("init_method", init_method)):
        if value is not None and not isinstance(value, str):
            raise _type_error(name, "a string or None", value)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise _type_error("seed", "an int or None", seed)
    if seed is not None and not 0 <= seed <= _MAX_SEED - 1000:  # the sampler seeds with seed + epoch
        raise ValueError(f"MyDDPStrategy(seed={seed}): the sampler seed must be between 0 and {_MAX_SEED - 1000}"
                         f" (Lightning's seed_everything range, 0 to 2**32 - 1, less room for the epoch); pass a"
                         f" smaller seed, or None to use seed_everything's.")
    if store is not None and not isinstance(store, dist.Store):
        raise _type_error("store", "a torch.distributed.Store (e.g. FileStore) or None", store)
    if not isinstance(allow_cpu_oversubscription, bool):
        raise _type_error("allow_cpu_oversubscription", "True or False", allow_cpu_oversubscription)
    if not isinstance(checkpoint_on_sigterm, (bool, str, os.PathLike)):
        raise _type_error("checkpoint_on_sigterm", "True, False or a file path", checkpoint_on_sigterm)
    if isinstance(checkpoint_on_sigterm, (str, os.PathLike)) and not os.fspath(checkpoint_on_sigterm):
        raise ValueError("MyDDPStrategy(checkpoint_on_sigterm='') is an empty path; pass a file path, True for"
                         " <default_root_dir>/sigterm.ckpt, or False.")
    n = verify_sync_every_n_steps
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
        raise _type_error("verify_sync_every_n_steps", "a whole number of optimizer steps or None", n)
    if n is not None and n < 1:
        raise ValueError(f"verify_sync_every_n_steps must be a positive number of optimizer steps or None, got {n}.")
    if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real)):
        raise _type_error("bucket_cap_mb", "a number of MiB or None", bucket_cap_mb)
    for name, value in ddp_flags.items():
        if not isinstance(value, (bool, numbers.Integral)):
            rank_zero_warn(f"MyDDPStrategy({name}={value!r}) is not True or False; DistributedDataParallel will"
                           f" treat it as {bool(value)}. Pass True or False.")


@dataclass(frozen=True)
class StrategyOptions:
    """The strategy's arguments after checking (see :class:`~ddp_strategy.strategy.MyDDPStrategy` for each)."""

    process_group_backend: str | None
    timeout: timedelta
    start_method: str
    seed: int | None
    init_method: str | None
    store: dist.Store | None
    allow_cpu_oversubscription: bool
    barrier_timeout: timedelta
    checkpoint_on_sigterm: bool | str | os.PathLike
    ddp_kwargs: dict[str, Any]
    comm_hook: sync.CommHookConfig
    verify_sync_every_n_steps: int | None
    exact_evaluation: bool

    def sigterm_checkpoint_path(self, trainer: Any) -> str | None:
        """Where to save on SIGTERM: the given path, ``<default_root_dir>/sigterm.ckpt`` for True, else None."""
        if isinstance(self.checkpoint_on_sigterm, (str, os.PathLike)):
            return os.fspath(self.checkpoint_on_sigterm)
        if self.checkpoint_on_sigterm and trainer is not None:
            return os.path.join(trainer.default_root_dir, "sigterm.ckpt")
        return None


def strategy_options(
    *, process_group_backend: Any, timeout: Any, start_method: Any, seed: Any, init_method: Any, store: Any,
    allow_cpu_oversubscription: Any, monitored_barrier_timeout: Any, checkpoint_on_sigterm: Any,
    ddp_comm_hook: Any, ddp_comm_state: Any, ddp_comm_wrapper: Any, verify_sync_every_n_steps: Any,
    exact_evaluation: Any, find_unused_parameters: Any, static_graph: Any, gradient_as_bucket_view: Any,
    bucket_cap_mb: Any, broadcast_buffers: Any, ddp_kwargs: dict[str, Any],
) -> StrategyOptions:
    """Check every argument of ``MyDDPStrategy(...)`` and return them as :class:`StrategyOptions`.

    ``start_method=None`` becomes :func:`ddp_strategy.process.default_start_method`; timeouts in seconds become
    ``timedelta``; ``monitored_barrier_timeout=None`` becomes ``timeout``; DDP options equal to DDP's defaults
    are dropped (so none is passed by default) and unknown ones refused.

    Raises:
        TypeError, ValueError: see :func:`check_strategy_arguments`; also an unknown ``start_method``,
            ``process_group_backend`` or ``init_method`` scheme, a non-positive timeout, an unknown DDP
            option or comm hook, and ``store`` with ``start_method="spawn"``/``"forkserver"`` (a store
            cannot be pickled to the new processes).
    """
    flags = {"find_unused_parameters": find_unused_parameters, "static_graph": static_graph,
             "gradient_as_bucket_view": gradient_as_bucket_view, "broadcast_buffers": broadcast_buffers}
    check_strategy_arguments(process_group_backend, start_method, seed, init_method, store,
                             allow_cpu_oversubscription, checkpoint_on_sigterm, verify_sync_every_n_steps,
                             bucket_cap_mb, flags)
    if start_method is not None and start_method not in process.START_METHODS:
        raise ValueError(f"Unknown start_method={start_method!r}; use one of {list(process.START_METHODS)} or None.")
    process.validate_backend_name(process_group_backend)
    process.validate_init_method(init_method)
    start_method = start_method or process.default_start_method()
    if store is not None and start_method in ("spawn", "forkserver"):
        raise ValueError(
            f"store= cannot be used with start_method={start_method!r}: a Store cannot be pickled to the"
            " new processes. Use start_method='fork' or 'popen' (with a FileStore path every process opens),"
            " or init_method='file:///path' instead."
        )
    timeout = process.as_timedelta(timeout)
    return StrategyOptions(
        process_group_backend=process_group_backend,
        timeout=timeout,
        start_method=start_method,
        seed=seed,
        init_method=init_method,
        store=store,
        allow_cpu_oversubscription=allow_cpu_oversubscription,
        barrier_timeout=(timeout if monitored_barrier_timeout is None
                         else process.as_timedelta(monitored_barrier_timeout)),
        checkpoint_on_sigterm=checkpoint_on_sigterm,
        ddp_kwargs=sync.validate_ddp_kwargs({**sync.non_default_options({**flags, "bucket_cap_mb": bucket_cap_mb}),
                                             **ddp_kwargs}),
        comm_hook=sync.CommHookConfig(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper),
        verify_sync_every_n_steps=verify_sync_every_n_steps,
        exact_evaluation=exact_evaluation,
    )


#: ``MyDDPStrategy``'s own arguments (those not passed to Lightning's ``ParallelStrategy``), by name: the
#: keyword arguments of :func:`strategy_options` other than ``ddp_kwargs``.
STRATEGY_ARGUMENTS: tuple[str, ...] = tuple(name for name in inspect.signature(strategy_options).parameters
                                            if name != "ddp_kwargs")
