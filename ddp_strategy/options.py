"""Type and range checks for ``MyDDPStrategy(...)``'s own arguments, run in its ``__init__``.

Only arguments Lightning's ``DDPStrategy`` does not have are refused when mistyped (``seed``,
``init_method``, ``store``, ...). The DDP options Lightning passes through to
``DistributedDataParallel`` unchecked keep Lightning's behaviour: a non-bool flag is accepted with a
warning (DDP reads it as true or false), and only a value DDP itself would crash on later, in every rank,
is refused now (``bucket_cap_mb="25"``).
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import torch.distributed as dist

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
