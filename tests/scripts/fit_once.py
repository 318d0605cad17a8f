"""A short 2-process fit with the default (popen) start method, then a normal interpreter exit.

Usage: python fit_once.py OUT_DIR [extra: torchrun | cpu3 | ddp]. Under torchrun it joins as one of 2 nodes instead
of launching. With cpu3 it pins itself (and so its ranks) to 2 CPU cores and fits on devices=3: more processes
than cores. With ddp it fits under Lightning's strategy="ddp". Each rank writes what it saw to
OUT_DIR/rank{global_rank}.pt, with the threads the fit left running once Lightning's own test suite has stopped
them (its ``thread_police_duuu_daaa_duuu_daaa`` fixture: a daemon thread with a ``stop`` is stopped and must be gone),
and, from an ``atexit`` hook registered before the fit (so run after any the fit registered), whether a process group
was still initialised at the interpreter's exit, to OUT_DIR/exit{global_rank}.txt.
"""

import atexit
import os
import sys
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.utilities.rank_zero import rank_zero_only

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_testing import quiet_trainer  # noqa: E402

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy  # noqa: E402


class Record(L.Callback):
    seen: dict = {}  # noqa: RUF012 - read only; MyDDPStrategy's fits replace it

    def on_train_start(self, trainer, pl_module):
        s = trainer.strategy
        self.seen = {
            "world_size": s.world_size,
            "global_rank": s.global_rank,
            "node_rank": s.node_rank,
            "local_rank": s.local_rank,
            "node_ranks": s.node_ranks,
            "env": type(s.cluster_environment).__name__,
            "rank_zero_only": rank_zero_only.rank,
            "backend": s.process_group_backend,
            "node_group_size": torch.distributed.get_world_size(s.node_group),
        }


def leaked_threads(before: set[threading.Thread]) -> list[str]:
    """The threads started since ``before`` that Lightning's thread police would fail a test for."""
    for thread in set(threading.enumerate()) - before:
        stop = getattr(thread, "stop", None) or getattr(thread, "exit", None)
        if thread.daemon and callable(stop):
            stop()
        elif isinstance(thread, _ChildProcessObserver):
            thread.join(timeout=10)
    return [thread.name for thread in set(threading.enumerate()) - before if thread.is_alive()]


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "local"
    L.seed_everything(7)
    topology = {"devices": 1, "num_nodes": 2} if mode == "torchrun" else {"devices": 2}
    if mode == "cpu3":
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
        topology = {"devices": 3}
    record = Record()
    trainer = quiet_trainer(
        strategy="ddp" if mode == "ddp" else MyDDPStrategy(timeout=60),
        max_steps=5 if mode == "torchrun" else 2,
        limit_val_batches=2,
        callbacks=[] if mode == "ddp" else [record],
        **topology,
    )
    model = DigitsClassifier()
    before = set(threading.enumerate())
    atexit.register(
        lambda: (out / f"exit{trainer.global_rank}.txt").write_text(str(torch.distributed.is_initialized()))
    )
    trainer.fit(model, DigitsDataModule())
    leaked = leaked_threads(before)
    torch.save({**record.seen, "final": model.state_dict(), "leaked": leaked}, out / f"rank{trainer.global_rank}.pt")
