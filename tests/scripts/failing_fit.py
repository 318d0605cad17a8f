"""A short 2-process fit that goes wrong on purpose, for tests/process/test_failures.py.

Usage: python failing_fit.py OUT_DIR SCENARIO START_METHOD (or ``ddp``: Lightning's DDPStrategy, popen, a 20 s
collective timeout)

Each rank writes OUT_DIR/started_rank{r} when training starts and OUT_DIR/failing_at when it triggers the
failure (a time.time() stamp), so the test can measure how long the job takes to end. In the sigterm and
sigint scenarios each rank writes OUT_DIR/waiting_rank{r} at step 3 and waits there for the test's signal (in
sigint_save, with an ``OnExceptionCheckpoint``, rank 0 alone waits: rank 1 goes on to the gradient all-reduce). The
launching process writes OUT_DIR/finally_rank0 in a ``finally`` around ``fit`` (popen: it must not be killed first),
and rank 0 writes OUT_DIR/finished (the steps taken) if the fit ends normally. In that ``finally`` each process
writes OUT_DIR/environ_rank{r}: the names of the environment variables that differ from the script's start. In
the refit scenario every rank fails at epoch 1, the script catches it and fits again; each rank writes
OUT_DIR/refit_rank{r} (the steps taken).
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import sklearn  # noqa: F401 (imported by the data module; its import sets KMP_* variables, before start_environ)
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_testing import quiet_trainer  # noqa: E402

from ddp_strategy import DDPCheckpointIO, DigitsClassifier, DigitsDataModule, MyDDPStrategy  # noqa: E402

# Ctrl+C raises KeyboardInterrupt as in a terminal, even when the suite itself was started in the background
# (a non-interactive shell's `cmd &` makes SIGINT ignored, and an ignored signal stays ignored across exec).
signal.signal(signal.SIGINT, signal.default_int_handler)

OUT, SCENARIO, START_METHOD = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
FAIL_STEP = 3


def mark_failing() -> None:
    (OUT / "failing_at").write_text(str(time.time()))


def wait_for_the_signal(trainer: L.Trainer, limit_s: float = 120.0) -> None:
    """Mid-training, tell the test (OUT/waiting_rank{r}) and wait until the signal it then sends has come.

    Explicit synchronisation with the test, so the signal always lands mid-training whatever the machine's
    speed: SIGTERM (forwarded to every rank) is seen here by a handler in front of the strategy's, which acts on
    it at a later step boundary; SIGINT raises KeyboardInterrupt in the launching rank, and the launcher stops
    the others.
    """
    came: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)

    def note(signum, frame):
        came.append(signum)
        signal.signal(signal.SIGTERM, previous)
        previous(signum, frame)

    signal.signal(signal.SIGTERM, note)
    (OUT / f"waiting_rank{trainer.global_rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + limit_s
    while not came and time.monotonic() < deadline:
        time.sleep(0.05)


class Model(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        if SCENARIO == "train_raise" and self.global_rank == 1 and self.global_step == FAIL_STEP:
            mark_failing()
            raise ZeroDivisionError("rank 1 divided by zero on purpose")
        if SCENARIO == "sigkill" and self.global_rank == 1 and self.global_step == FAIL_STEP:
            mark_failing()
            os.kill(os.getpid(), signal.SIGKILL)
        if SCENARIO == "save_sync_alone":  # reduced at the epoch's end, on every rank
            self.log("synced_epoch", torch.tensor(1.0), on_step=False, on_epoch=True, sync_dist=True)
        if SCENARIO == "raw_barrier" and self.global_rank == 1 and self.global_step == FAIL_STEP:
            mark_failing()  # not the strategy's: nothing of ours runs before it
            torch.distributed.barrier()  # rank 1 alone; rank 0 goes on to its gradient all-reduce
        if SCENARIO == "skip_log" and not (self.global_rank == 1 and self.global_step == FAIL_STEP):
            self.log("synced", torch.tensor(1.0), on_step=True, sync_dist=True)
        elif SCENARIO == "skip_log":
            mark_failing()
        if SCENARIO in ("sigterm", "sigint") and self.global_step == FAIL_STEP:
            wait_for_the_signal(self.trainer)
        if SCENARIO == "sigint_save" and self.global_step == FAIL_STEP:  # rank 1 goes on to the gradient all-reduce
            (OUT / f"waiting_rank{self.global_rank}").write_text(str(os.getpid()))
            while self.global_rank == 0:
                time.sleep(0.05)
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss):  # after the strategy's pre_backward: the round goes with the backward pass
        if SCENARIO == "skip_log_backward" and self.global_rank == 0 and self.global_step == FAIL_STEP:
            mark_failing()
            self.log("before_backward", loss.detach(), on_step=True, sync_dist=True)  # rank 0 alone

    def log(self, name, value, *args, **kwargs):
        if not (SCENARIO in ("save_epoch_alone", "gather_epoch_alone", "save_sync_alone") and name == "train_acc"):
            super().log(
                name, value, *args, **kwargs
            )  # sync: the others go on to the next epoch's start (else: timeout)

    def on_train_batch_start(self, batch, batch_idx):
        if SCENARIO == "skip_alone" and self.global_rank == 1 and self.global_step == FAIL_STEP:
            mark_failing()
            return -1  # rank 1 alone ends its epoch
        if SCENARIO == "stop_alone" and self.global_rank == 1 and self.current_epoch == 1 and batch_idx == FAIL_STEP:
            mark_failing()
            self.trainer.should_stop = True  # rank 1 alone leaves the fit after this step (min_epochs=1 is met)
        return super().on_train_batch_start(batch, batch_idx)

    def on_train_epoch_end(self):
        if SCENARIO == "reduce_epoch_alone" and self.global_rank == 0 and self.current_epoch == 0:
            mark_failing()  # reduced at the epoch's end on rank 0 alone, after the metrics every rank syncs there
            self.log("rank_0_only", torch.tensor(1.0), sync_dist=True)
        if SCENARIO == "gather_epoch_alone" and self.global_rank == 0 and self.current_epoch == 0:
            mark_failing()  # Lightning's LightningModule.all_gather holds the world group in its frame
            self.all_gather(torch.tensor(1.0))

    def validation_step(self, batch, batch_idx):
        if SCENARIO == "val_raise" and self.global_rank == 0:
            mark_failing()
            raise KeyError("rank 0 lost a key in validation on purpose")
        return super().validation_step(batch, batch_idx)


class Events(L.Callback):
    def on_train_start(self, trainer, pl_module):
        (OUT / f"started_rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if SCENARIO == "callback_raise" and trainer.global_rank == 1 and trainer.global_step == FAIL_STEP:
            mark_failing()
            raise ValueError("a callback on rank 1 failed on purpose")
        if SCENARIO == "save_raise" and trainer.global_step == FAIL_STEP:  # every rank; rank 0's write fails
            trainer.save_checkpoint(OUT / "step.ckpt")
        if SCENARIO == "save_alone" and trainer.global_rank == 0 and trainer.global_step == FAIL_STEP:
            mark_failing()
            trainer.save_checkpoint(OUT / "step.ckpt")  # rank 0 alone: its save's barrier meets rank 1's step

    def on_fit_start(self, trainer, pl_module):
        if SCENARIO == "fit_start_raise" and trainer.global_rank == 0:
            mark_failing()  # rank 1 goes on to Lightning's run-stage barrier: the side group's first use
            raise ValueError("rank 0 failed at the fit's start on purpose")

    def on_train_epoch_end(self, trainer, pl_module):
        if SCENARIO == "epoch_end_raise" and trainer.global_rank == 0 and trainer.current_epoch == 0:
            mark_failing()  # rank 1 goes on to the next epoch's barrier (or waits in an epoch-end metric sync)
            raise ValueError("rank 0 failed at its epoch's end on purpose")
        if SCENARIO in ("save_epoch_alone", "save_sync_alone", "save_metric_alone") and trainer.global_rank == 0:
            mark_failing()  # rank 0 alone: its save's barrier meets rank 1's epoch start (save_epoch_alone), its
            trainer.save_checkpoint(OUT / "epoch.ckpt")  # epoch-level reduce (sync_alone), its metric sync (metric)
        if SCENARIO in ("end_alone", "end_reduce_alone") and trainer.global_rank == 1 and trainer.current_epoch == 0:
            mark_failing()
            trainer.should_stop = True  # rank 1 alone ends the fit after its epoch's last batch; rank 0 goes on

    def on_train_end(self, trainer, pl_module):
        if SCENARIO == "end_reduce_alone":  # every rank's, at its fit's end: rank 1 ended it alone
            trainer.strategy.reduce(torch.tensor(1.0))

    def on_train_epoch_start(self, trainer, pl_module):
        if SCENARIO == "refit" and trainer.current_epoch == 1:
            mark_failing()
            raise RuntimeError(f"rank {trainer.global_rank} fails on purpose; the script fits again")
        if SCENARIO == "stall" and trainer.global_rank == 1 and trainer.current_epoch == 1:
            mark_failing()
            time.sleep(3600)


class FullDisk(DDPCheckpointIO):
    """A checkpoint plugin whose writes fail, as on a full disk (only rank 0 writes)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        mark_failing()
        raise OSError("disk full on purpose")


class UnevenData(DigitsDataModule):
    def train_dataloader(self):
        # The user's own sampler (respected by the strategy), with rank 1 given less data than rank 0.
        subset = torch.utils.data.Subset(self.train_set, range(200 if self.trainer.global_rank == 0 else 100))
        mark_failing()
        return DataLoader(subset, batch_size=32, sampler=DistributedSampler(subset, num_replicas=1, rank=0))


if __name__ == "__main__":
    L.seed_everything(3)
    start_environ = dict(os.environ)
    timeout = (
        10
        if SCENARIO == "raw_barrier"
        else 20
        if SCENARIO.endswith("_alone") or SCENARIO.startswith("skip_log")
        else 60
    )  # raw_barrier waits for it: the ranks' collectives do not match (its join: not under 10 s on a loaded machine)
    strategy = (
        DDPStrategy(timeout=timedelta(seconds=20 if timeout == 60 else timeout))
        if START_METHOD == "ddp"
        else MyDDPStrategy(
            start_method=START_METHOD,
            timeout=timeout,
            monitored_barrier_timeout=5,
            checkpoint_on_sigterm=str(OUT / "sigterm.ckpt"),
            uneven_inputs="error" if SCENARIO == "uneven" else "join",
        )
    )  # the default trains them
    trainer = quiet_trainer(
        2,
        strategy,
        max_epochs=3,
        limit_train_batches=6,
        limit_val_batches=3,
        callbacks=[Events(), *([OnExceptionCheckpoint(str(OUT))] if SCENARIO == "sigint_save" else [])],
        enable_checkpointing=SCENARIO == "sigint_save",
        default_root_dir=str(OUT),
        plugins=[FullDisk()] if SCENARIO == "save_raise" else [],
    )
    data = UnevenData() if SCENARIO == "uneven" else DigitsDataModule()
    try:
        try:
            trainer.fit(Model(), data)
        except RuntimeError:  # refit: the user's script catches the failure and fits again in the same processes
            if SCENARIO != "refit":
                raise
            again = quiet_trainer(
                2,
                MyDDPStrategy(start_method=START_METHOD),
                max_epochs=1,
                limit_train_batches=6,
                limit_val_batches=0,
            )
            again.fit(Model(), DigitsDataModule())
            (OUT / f"refit_rank{again.global_rank}").write_text(str(again.global_step))
    finally:
        changed = {k for k in {**start_environ, **os.environ} if start_environ.get(k) != os.environ.get(k)}
        (OUT / f"environ_rank{trainer.global_rank}").write_text(" ".join(sorted(changed)))
        if trainer.global_rank == 0 or START_METHOD not in ("popen", "ddp"):
            (OUT / "finally_rank0").write_text(str(os.getpid()))
    if trainer.global_rank == 0:
        (OUT / "finished").write_text(str(trainer.global_step))
