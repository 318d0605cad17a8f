"""Worker for tests/sampling/test_error_suggestions.py: errors and warnings that exist only with 2 ranks, and fixes.

Runs in 2 real gloo processes started by :func:`sampling_workers.launch` and records what each rank saw in
``out_dir/suggestions.rank<R>.pt``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from data_workers import BATCH, N, Seen, own_half
from sampling_workers import Indexed, save, trainer
from torch.utils.data import DataLoader, Subset

from ddp_strategy import all_gather_rows


def rank() -> int:
    return int(os.environ["LOCAL_RANK"])


class Gathering(Seen):
    """Validation collects each sample's index and gathers them at epoch end, padded (all_gather) or exact."""

    def __init__(self, exact: bool) -> None:
        super().__init__({"val": lambda: DataLoader(Indexed(3, 1), batch_size=4)})
        self.exact = exact
        self.outputs: list[torch.Tensor] = []
        self.gathered: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.outputs.append(batch[3])

    def on_validation_epoch_end(self) -> None:
        mine = torch.cat(self.outputs)
        both = all_gather_rows(mine) if self.exact else self.all_gather(mine).flatten(0, 1)
        self.gathered = both.tolist()


def scenario_suggestions(out: Path) -> None:
    """Uneven user shards (refused), then each suggested fix; the padded all_gather warning, then all_gather_rows."""
    record: dict[str, Any] = {}
    uneven = Seen({"train": lambda: DataLoader(Subset(Indexed(N, 0), range(rank(), N - 8 * rank(), 2)),
                                               batch_size=BATCH)})
    try:
        trainer(2, out, max_epochs=1, use_distributed_sampler=False).fit(uneven)
        record["uneven_error"] = None
    except ValueError as error:
        record["uneven_error"] = str(error)
    # Fix 1: let the strategy shard the whole data set (use_distributed_sampler=True, the default).
    whole = Seen({"train": lambda: DataLoader(Indexed(N - 4, 0), batch_size=BATCH)})
    trainer(2, out, max_epochs=1).fit(whole)
    record["sharded"] = whole.seen["train"]
    # Fix 2: the user's own shards, made to hold the same number of batches.
    equal = Seen({"train": own_half(0)})
    trainer(2, out, max_epochs=1, use_distributed_sampler=False).fit(equal)
    record["equal"] = equal.seen["train"]
    # 3 validation samples on 2 ranks: self.all_gather pads and warns; all_gather_rows, as it suggests, is exact.
    for exact in (False, True):
        model = Gathering(exact)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(2, out).validate(model, verbose=False)
        record[f"gathered_exact={exact}"] = model.gathered
        record[f"warnings_exact={exact}"] = [str(w.message) for w in caught if "all_gather got" in str(w.message)]
    save(out, "suggestions", record)
