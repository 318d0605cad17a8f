"""SIGTERM on any one rank stops every rank at the same step (the documented bound), and the step is collective-free.

One shared 2-rank run (``run_on_ranks``, gloo) per rank does, in order: an uninterrupted fit (the reference, also
counting the world group's collectives per step), the same under Lightning's ``ddp``, then for rank 0 and for rank 1
a fit in which that rank alone sends itself SIGTERM at a random step, followed by a resume from the SIGTERM checkpoint;
then the same for rank 1 with ``accumulate_grad_batches=2``, the signal at a window's last batch.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from ddp_testing import free_port, quiet_trainer, state_copy

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy, count_collective_bytes
from ddp_strategy.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEPS, EPOCHS = 6, 2  # per epoch; 12 steps in all, each rank 32 samples a step
SIGNAL_STEPS = {rank: random.Random().randrange(EPOCHS * STEPS - 1) for rank in (0, 1)}  # global_step at the signal
# accumulate_grad_batches=2: 3 windows an epoch; not an epoch's last, where the epoch's end stops every rank anyway
ACCUMULATED_SIGNAL_STEP = random.Random().choice([0, 1, 3, 4])


class Signalled(DigitsClassifier):
    """Sends SIGTERM to its own process at ``global_step == step`` on ``rank``; records the world group's collective
    count and the comm hook's bucket count at each step's start."""

    def __init__(self, rank: int = -1, step: int = -1) -> None:
        super().__init__()
        self.signal_rank, self.signal_step = rank, step  # at the step's last batch (its window's)
        self.world_seq: list[int] = []
        self.buckets: list[int] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # ProcessGroup's own count of the collectives issued on it (not a patch: torch keeps it for desync checks)
        self.world_seq.append(dist.group.WORLD._get_sequence_number_for_group())
        self.buckets.append(self._counts.calls if hasattr(self, "_counts") else 0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        last = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0
        if self.global_rank == self.signal_rank and self.global_step == self.signal_step and last:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def _fit(root: Path, model: Signalled, strategy: Any, ckpt_path: str | None = None, accumulate: int = 1) -> dict:
    pl.seed_everything(5)
    trainer = quiet_trainer(
        2,
        strategy,
        accumulate_grad_batches=accumulate,
        max_epochs=EPOCHS,
        limit_train_batches=STEPS,
        limit_val_batches=2,
        default_root_dir=str(root),
    )
    stopped = None
    with count_collective_bytes() as model._counts:
        try:
            trainer.fit(model, DigitsDataModule(), ckpt_path=ckpt_path)
        except SystemExit as e:  # Lightning's SIGTERMException
            stopped = type(e).__name__
    return {
        "stopped": stopped,
        "global_step": trainer.global_step,
        "world_seq": model.world_seq,
        "buckets": model.buckets,
        "weights": state_copy(model),
    }


def _strategy(port: int, root: Path | None = None) -> MyDDPStrategy:
    # a port per fit: a fit after a failed (SIGTERM) one must not reach the old group's store, still closing
    return MyDDPStrategy(
        timeout=30,
        ddp_comm_hook="allreduce",
        init_method=f"tcp://127.0.0.1:{port}",
        checkpoint_on_sigterm=str(root / "sigterm.ckpt") if root is not None else False,
    )


def _runs(rank: int, world_size: int, out: str, signal_steps: dict[int, int], ports: list[int], window: int) -> dict:
    out_dir, records, port = Path(out), {}, iter(ports)
    pl.seed_everything(5)
    records["reference"] = _fit(out_dir / "reference", Signalled(), _strategy(next(port)))
    pl.seed_everything(5)
    records["lightning"] = _fit(out_dir / "lightning", Signalled(), "ddp")
    for signalled, step in signal_steps.items():
        root = out_dir / f"signal{signalled}"
        pl.seed_everything(5)
        records[f"signal{signalled}"] = _fit(root, Signalled(signalled, step), _strategy(next(port), root))
        pl.seed_everything(5)
        records[f"resume{signalled}"] = _fit(
            root / "resume", Signalled(), _strategy(next(port)), str(root / "sigterm.ckpt")
        )
    root = out_dir / "accumulated"  # rank 1 alone, at the last batch of window `window` (2 batches)
    pl.seed_everything(5)
    records["accumulated_reference"] = _fit(root / "reference", Signalled(), _strategy(next(port)), accumulate=2)
    pl.seed_everything(5)
    records["accumulated_signal"] = _fit(root, Signalled(1, window), _strategy(next(port), root), accumulate=2)
    pl.seed_everything(5)
    records["accumulated_resume"] = _fit(
        root / "resume", Signalled(), _strategy(next(port)), str(root / "sigterm.ckpt"), accumulate=2
    )
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    """Every rank's records of the shared run."""
    ports = [free_port() for _ in range(8)]
    args = (str(tmp_path_factory.mktemp("sigterm")), SIGNAL_STEPS, ports, ACCUMULATED_SIGNAL_STEP)
    return run_on_ranks(_runs, 2, args=args, init_process_group=False, timeout_s=240)


def _expected_stop(step: int) -> int:
    """global_step when every rank stops for a SIGTERM in step ``step``'s ``training_step``: the end of that step
    (the round before its backward pass carries the flag; docs/failures.md)."""
    return step + 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signalled", [0, 1])
def test_sigterm_to_one_rank_stops_every_rank_at_one_step_and_resumes_exactly(runs, signalled):
    """SIGTERM to rank `signalled` alone at a random step: both stop after that step; resuming gives the weights."""
    step = SIGNAL_STEPS[signalled]
    stopped = [r[f"signal{signalled}"] for r in runs]
    assert [r["stopped"] for r in stopped] == ["SIGTERMException"] * 2, step
    assert [r["global_step"] for r in stopped] == [_expected_stop(step)] * 2, step
    resumed = [r[f"resume{signalled}"] for r in runs]
    assert [r["stopped"] for r in resumed] == [None, None]
    for rank, record in enumerate(resumed):
        assert record["global_step"] == EPOCHS * STEPS
        for name, value in runs[rank]["reference"]["weights"].items():
            torch.testing.assert_close(record["weights"][name], value, rtol=0, atol=1e-6, msg=f"{name}, step {step}")


@pytest.mark.timeout(300)
def test_sigterm_inside_an_accumulation_window_stops_at_its_end_and_resumes_exactly(runs):
    """accumulate_grad_batches=2, SIGTERM to rank 1 in a window's last batch's training_step: both ranks stop at
    that window's end (the round before its backward pass carries it; a signal in a window's first batch would stop
    at the window's end too, not after that batch, whose gradient the checkpoint cannot hold); the resume is exact."""
    step, windows = ACCUMULATED_SIGNAL_STEP, STEPS // 2
    stopped = [r["accumulated_signal"] for r in runs]
    assert [r["stopped"] for r in stopped] == ["SIGTERMException"] * 2, step
    assert [r["global_step"] for r in stopped] == [step + 1] * 2, step
    for rank, record in enumerate(r["accumulated_resume"] for r in runs):
        assert record["stopped"] is None and record["global_step"] == EPOCHS * windows
        for name, value in runs[rank]["accumulated_reference"]["weights"].items():
            torch.testing.assert_close(record["weights"][name], value, rtol=0, atol=1e-6, msg=f"{name}, step {step}")


@pytest.mark.timeout(300)
def test_a_training_step_has_no_collective_on_the_world_group_but_the_gradient_buckets(runs):
    """Between an epoch's first and last step: world-group collectives = DDP's buckets; Lightning's ddp: +1 per step."""
    for record in runs:
        ours, lightning = record["reference"], record["lightning"]
        for epoch in range(EPOCHS):  # fit's first 2 steps: our unused-parameter check, DDP's bucket rebuild (once)
            steps = slice(epoch * STEPS + (2 if epoch == 0 else 0), (epoch + 1) * STEPS)
            seq, buckets, seq_pl = ours["world_seq"][steps], ours["buckets"][steps], lightning["world_seq"][steps]
            per_step = [b - a for a, b in zip(seq, seq[1:], strict=False)]
            assert per_step == [b - a for a, b in zip(buckets, buckets[1:], strict=False)] and min(per_step) >= 1
            per_step_pl = [b - a for a, b in zip(seq_pl, seq_pl[1:], strict=False)]
            assert per_step_pl == [n + 1 for n in per_step]  # Lightning's: its SIGTERM broadcast before each batch
