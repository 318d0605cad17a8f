"""Which device, node and rank this process is: the topology a Lightning ``ParallelStrategy`` reports.

:class:`RankTopology` is a mixin of :class:`~ddp_strategy.strategy.MyDDPStrategy`: world size W =
``num_nodes * num_processes``, global rank = ``node_rank * num_processes + local_rank`` (node-major, as
Lightning's and torchrun's launchers number ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from ddp_strategy._compat.namespace import rank_zero_only
from ddp_strategy.process.launching import StartMethod, check_launch_env


class RankTopology:
    """Topology properties for a strategy with ``parallel_devices``, ``cluster_environment`` and ``local_rank``."""

    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    _num_nodes: int = 1
    _process_group_backend: str | None = None
    _run: Any  # a ProcessGroupRun
    _options: Any  # the strategy's StrategyOptions

    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: ``parallel_devices[local_rank]``."""
        assert self.parallel_devices is not None, "the Trainer sets parallel_devices before use"
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Number of machines (Lightning's ``Trainer(num_nodes=...)``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always True: tells Lightning to synchronise ``self.log(..., sync_dist=True)`` values."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``num_replicas`` (world size) and ``rank`` (global rank) for a ``DistributedSampler``."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Check the launch variables (every rank, in ``Trainer(...)``), then set this process's global rank.

        Raises:
            ValueError: ``MASTER_PORT``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE`` or ``RANK`` is empty, not an
                integer or out of range (:func:`ddp_strategy.process.check_launch_env`).
        """
        if self.cluster_environment is not None:
            check_launch_env(self.cluster_environment, self.num_nodes, self.num_processes)
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @property
    def process_group_backend(self) -> str | None:
        """The backend in use once the process group exists, else the user's choice (or None)."""
        return self._process_group_backend

    @property
    def node_group(self) -> Any:
        """The intra-node process group of this rank (the world group on one node); None before setup."""
        return self._run.node_group

    @property
    def node_ranks(self) -> list[int]:
        """Global ranks on this rank's node, e.g. ``[2, 3]`` for node 1 of 2 with 2 devices each."""
        return list(self._run.node_ranks)

    @property
    def start_method(self) -> StartMethod:
        """How processes are started: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``."""
        return self._options.start_method
