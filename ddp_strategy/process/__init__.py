"""Step 1, the process group: launching, rendezvous, backend, failures, teardown, and the collectives.

Owns: which launcher starts the ranks and what is refused before any process starts
(:mod:`~ddp_strategy.process.launching`), the rendezvous store of each run
(:mod:`~ddp_strategy.process.rendezvous`), the world process group's creation, lifetime and destruction
(:mod:`~ddp_strategy.process.group`), naming the rank that failed (:mod:`~ddp_strategy.process.failures`) and
``all_gather`` of uneven tensors (:mod:`~ddp_strategy.process.collectives`). Must not touch: loaders, the model or
checkpoints. Entry point: :class:`ProcessGroupRun`.
"""

from ddp_strategy.process.collectives import all_gather_padded, all_gather_rows, gather_shapes, on_global_zero
from ddp_strategy.process.failures import proc_stat
from ddp_strategy.process.group import (
    DEFAULT_TIMEOUT,
    all_reduce,
    as_timedelta,
    destroy_process_group,
    device_ids,
    init_process_group,
    validate_backend_name,
    validate_init_method,
)
from ddp_strategy.process.launching import START_METHODS, StartMethod, check_launch_env, default_start_method
from ddp_strategy.process.rendezvous import free_port
from ddp_strategy.process.run import ProcessGroupRun, launched_ranks

__all__ = ["DEFAULT_TIMEOUT", "START_METHODS", "ProcessGroupRun", "StartMethod", "all_gather_padded",
           "all_gather_rows", "all_reduce", "as_timedelta", "check_launch_env", "default_start_method",
           "destroy_process_group", "device_ids", "free_port", "gather_shapes", "init_process_group", "launched_ranks",
           "on_global_zero", "proc_stat", "validate_backend_name", "validate_init_method"]
