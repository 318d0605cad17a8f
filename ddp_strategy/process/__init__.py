"""Step 1, the process group. Owns: launching and its checks (:mod:`~ddp_strategy.process.launching`), the world group,
reused by every run in a process as under Lightning's ``ddp`` (:mod:`~ddp_strategy.process.group`), the failure
protocol (:mod:`~ddp_strategy.process.failures`), the epoch- and step-boundary checks
(:mod:`~ddp_strategy.process.boundaries`) ``all_gather`` of uneven tensors and the
strategy's all-reduce (:mod:`~ddp_strategy.process.collectives`). Must not touch: loaders, the model or checkpoints.
"""

from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.process import boundaries, failures, launching
from ddp_strategy.process.collectives import (
    all_gather_padded,
    all_gather_rows,
    all_reduce,
    gather_shapes,
)
from ddp_strategy.process.group import (
    DEFAULT_TIMEOUT,
    ProcessGroupRun,
    as_timedelta,
    device_ids,
    validate_init_method,
)
from ddp_strategy.process.launching import START_METHODS, StartMethod, check_launch_env, default_start_method

#: Lightning's ``find_free_network_port`` (for the demo): a port free a moment ago.
free_port = _namespace.get("fabric.plugins.environments.lightning:find_free_network_port")

__all__ = [
    "DEFAULT_TIMEOUT",
    "ProcessGroupRun",
    "START_METHODS",
    "StartMethod",
    "all_gather_padded",
    "all_gather_rows",
    "all_reduce",
    "as_timedelta",
    "boundaries",
    "check_launch_env",
    "default_start_method",
    "device_ids",
    "failures",
    "free_port",
    "gather_shapes",
    "launching",
    "validate_init_method",
]
