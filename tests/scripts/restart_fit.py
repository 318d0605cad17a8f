"""A fit with periodic step checkpoints that resumes from the last one, for tests/process/test_restarts.py.

Usage: python restart_fit.py OUT_DIR [--kill-step K] [--ckpt last|PATH] [--max-steps M] [--devices D]
       [--stages fit,test,refit] [--slow-teardown S] [--usr1-step K]

Run under ``torchrun`` (joins as the agent's workers) or as a plain script (popen launch). Rank 1 SIGKILLs
itself at global step K on torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT=0``), so the kill is
deterministic. ``--slow-teardown S`` makes rank 0 wait S seconds before each teardown, so the other ranks
reach the next stage's rendezvous while rank 0's old store is still alive. ``--usr1-step K`` makes rank 1
send itself SIGUSR1 at step K (SLURM's requeue warning, when launched with SLURM's variables). Each rank writes
OUT_DIR/rank{r}.pt: the attempt, the indices of every batch it trained on, final weights, test accuracy, and
the TCP sockets it listened on during the fit.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_testing import IndexedDigits, listening_sockets, quiet_trainer, state_copy  # noqa: E402

from ddp_strategy import DigitsClassifier, MyDDPStrategy  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Model(DigitsClassifier):
    def __init__(self, kill_step: int, usr1_step: int) -> None:
        super().__init__()
        self.kill_step, self.usr1_step = kill_step, usr1_step
        self.batches: list[tuple[int, int, list[int]]] = []  # (epoch, global step, sample indices)
        self.listening: list[tuple[str, int]] = []
        self.gloo_ifname: str | None = None

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        if self.global_rank == 1 and self.global_step == self.kill_step and ATTEMPT == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.global_rank == 1 and self.global_step == self.usr1_step:
            os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM does before the time limit (--signal=USR1@90)
        if not self.listening:  # the first step this process runs: every group and store is up
            self.listening = listening_sockets(os.getpid())
            self.gloo_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        self.batches.append((self.current_epoch, self.global_step, idx.tolist()))
        return super().training_step((x, y), batch_idx)


class SlowTeardown(MyDDPStrategy):
    def __init__(self, delay_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def teardown(self) -> None:
        if self.global_rank == 0:
            time.sleep(self.delay_s)
        super().teardown()


def trainer(args: argparse.Namespace, max_steps: int) -> L.Trainer:
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpts", every_n_train_steps=3, save_last=True, save_top_k=-1)
    return quiet_trainer(
        args.devices,
        SlowTeardown(args.slow_teardown, timeout=60),
        enable_checkpointing=True,
        max_steps=max_steps,
        limit_val_batches=2,
        callbacks=[checkpoints],
        default_root_dir=str(args.out),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", default="fit")
    parser.add_argument("--slow-teardown", type=float, default=0.0)
    parser.add_argument("--usr1-step", type=int, default=-1)
    args = parser.parse_args()
    L.seed_everything(11)
    model, data = Model(args.kill_step, args.usr1_step), IndexedDigits()
    record: dict = {"attempt": ATTEMPT}
    for stage in args.stages.split(","):
        if stage == "fit":
            t = trainer(args, args.max_steps)
            t.fit(model, data, ckpt_path=args.ckpt)
            record.update(
                global_step=t.global_step,
                batches=model.batches,
                listening=model.listening,
                final=state_copy(model),
                world_size=t.world_size,
                gloo_ifname=model.gloo_ifname,
                master_port=int(os.environ["MASTER_PORT"]),
            )
        elif stage == "test":
            record["test_acc"] = t.test(model, data, verbose=False)[0]["test_acc"]
        elif stage == "refit":  # a new Trainer in the same script: another rendezvous on the same port
            t = trainer(args, t.global_step + 2)
            t.fit(model, data, ckpt_path="last")
            record["refit_step"] = t.global_step
    torch.save(record, args.out / f"rank{t.global_rank}.pt")
