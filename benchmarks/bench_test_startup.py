"""Start-up cost of a 2-rank test: the testing kit against re-running a script per rank (popen) and spawn.

Usage: python benchmarks/bench_test_startup.py [--repeats 3]

Prints one markdown table: seconds from the call until every rank has returned, for
  * kit, plain function: ``run_on_ranks`` of a function that all-reduces one number (first call of the
    session, which starts the forkserver and imports torch/Lightning there, and the calls after it);
  * kit, Trainer.fit: ``run_on_ranks`` of a function that fits a tiny model for 2 steps with MyDDPStrategy;
  * popen / spawn: the same tiny fit as a script run with ``python``, MyDDPStrategy with
    ``start_method="popen"`` (Lightning's default launcher: the script re-run per rank) or ``"spawn"``.
Medians over ``--repeats`` runs, interleaved. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FIT = textwrap.dedent("""
    import sys
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from ddp_strategy import MyDDPStrategy


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    def fit(rank, world_size, start_method=None):
        data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        kwargs = {} if start_method is None else {"start_method": start_method}
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=MyDDPStrategy(**kwargs), max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        return trainer.global_step


    if __name__ == "__main__":
        fit(0, 2, sys.argv[1])
""")


def all_reduce_one(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([1.0])
    dist.all_reduce(value)
    return value.item()


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from ddp_strategy.testing import run_on_ranks

    folder = Path(tempfile.mkdtemp(prefix="bench_test_startup_"))
    (folder / "tiny_fit.py").write_text(FIT)
    sys.path.insert(0, str(folder))
    import tiny_fit

    first = timed(lambda: run_on_ranks(all_reduce_one, 2))
    rows: dict[str, list[float]] = {
        "kit, plain function": [],
        "kit, Trainer.fit": [],
        "popen, Trainer.fit": [],
        "spawn, Trainer.fit": [],
    }
    for _ in range(args.repeats):
        rows["kit, plain function"].append(timed(lambda: run_on_ranks(all_reduce_one, 2)))
        rows["kit, Trainer.fit"].append(timed(lambda: run_on_ranks(tiny_fit.fit, 2, init_process_group=False)))
        for method in ("popen", "spawn"):
            rows[f"{method}, Trainer.fit"].append(
                timed(
                    lambda m=method: subprocess.run(
                        [sys.executable, str(folder / "tiny_fit.py"), m], cwd=folder, check=True, capture_output=True
                    )
                )
            )
    print(f"2 ranks on CPU, median of {args.repeats} (interleaved); kit's first call of the session: {first:.2f} s")
    print()
    print("| how | seconds until every rank returned (median) | runs |")
    print("|---|---:|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
