"""A user's training script for a cluster engine that starts every rank itself (Kubeflow, LSF's jsrun, mpirun).

Usage: python engine_fit.py OUT_DIR STRATEGY ENGINE, with STRATEGY ``ddp`` (Lightning's) or ``ours``
(``MyDDPStrategy()``) and ENGINE one of:

- ``kubeflow``: a PyTorchJob's pod (one process per pod): ``plugins=[KubeflowEnvironment()]``, which Lightning does
  not detect, and ``Trainer(num_nodes=<replicas>, devices=1)``;
- ``lsf``: a ``jsrun`` task: Lightning detects ``LSFEnvironment``; ``Trainer(devices=<tasks per host>)``;
- ``mpi``: an ``mpirun`` process: ``plugins=[MPIEnvironment()]`` (Lightning would also detect it, with mpi4py);
  ``Trainer(devices=<processes per host>)``.

The script is the same for both strategies but for the ``strategy=`` argument. It fits the digits model for 2 epochs
(the training samples carry their index), validates once more after ``fit``, and each rank writes
OUT_DIR/rank{global_rank}.pt: the cluster environment, its ranks, the indices read per epoch, the final weights and
the validation accuracy.
"""

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.environments import KubeflowEnvironment, MPIEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_testing import IndexedDigits, RecordingClassifier, quiet_trainer  # noqa: E402

from ddp_strategy import MyDDPStrategy  # noqa: E402

if __name__ == "__main__":
    out, strategy, engine = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    L.seed_everything(7)
    setups = {  # each engine's Trainer arguments, as its documentation gives them
        "kubeflow": lambda: {"num_nodes": 2, "devices": 1, "plugins": [KubeflowEnvironment()]},
        "lsf": lambda: {"devices": 2},
        "mpi": lambda: {"devices": 2, "plugins": [MPIEnvironment()]},
    }
    trainer = quiet_trainer(
        strategy="ddp" if strategy == "ddp" else MyDDPStrategy(timeout=60),
        max_epochs=2,
        default_root_dir=out,
        **setups[engine](),
    )
    model, data = RecordingClassifier(str(out)), IndexedDigits(batch_size=32)
    trainer.fit(model, data)
    (metrics,) = trainer.validate(model, data, verbose=False)
    env = trainer.strategy.cluster_environment
    record = {
        "env": type(env).__name__,
        "ranks": (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank),
        "val_acc": metrics["val_acc"],
    }
    torch.save({**model.record, **record}, out / f"rank{trainer.global_rank}.pt")
