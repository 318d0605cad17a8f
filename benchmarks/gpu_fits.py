"""The checks of ``gpu_check.py`` that fit in-process on one GPU: what each one fits, and what it then checks.

Each check is a pair in :data:`CHECKS`: a *plan* builds its fits (the ``Trainer``, the module, its data and the
callbacks that watch it) for an accelerator, and a *check* runs them and returns a one-line summary, or raises
:class:`CheckFailed` saying what differed. On a GPU, ``gpu_check.py`` runs each check in a fresh process on
``accelerator="gpu", devices=1``: NCCL with world size 1, since two ranks cannot share one GPU under NCCL. Without a
GPU its dry run builds every plan on ``accelerator="cpu"`` and fits nothing, so a renamed argument or class fails
there too.

Imports ``ddp_strategy`` through its top-level names only; the sync-debug check trains ``lightning_worker.py``'s
``BenchModule`` on ``bench_workloads.py``'s small workload. Imports neither ``gpu_check.py`` nor the tests.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from bench_workloads import WORKLOADS, build_dataset
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_worker import BenchModule
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import ddp_strategy
from ddp_strategy import (
    DigitsClassifier,
    DigitsDataModule,
    DigitsNet,
    MyDDPStrategy,
    count_collective_bytes,
    load_plain_state_dict,
)

SEED = 1234
#: The two strategies every comparing check fits, in this order: (label, a new strategy argument for the Trainer).
STRATEGIES: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("Lightning ddp", lambda: "ddp"),
    ("MyDDPStrategy", MyDDPStrategy),
)
#: Largest weight difference, MyDDPStrategy against Lightning's ``ddp``, both seeded alike and ``deterministic=True``.
SAME_WEIGHTS_ATOL = 1e-5
#: Least validation accuracy of the digits model after 5 epochs (the suite's cuda fit asks it after 3).
MIN_VAL_ACC = 0.9
#: The comm hooks checked on NCCL, by ``MyDDPStrategy(ddp_comm_hook=...)`` name.
COMM_HOOKS = ("fp16", "powersgd")
#: PowerSGD's plain all-reduce steps before it compresses (``start_powerSGD_iter``, the strategy's default state).
POWERSGD_PLAIN_STEPS = 10
#: Sync-debug window: steps before it (the first step's one-off work), steps inside it.
SYNC_WARMUP_STEPS, SYNC_CHECKED_STEPS = 10, 20
SYNC_ERROR = "synchronizing CUDA operation"  # torch's message under set_sync_debug_mode("error")
_PACKAGE_FOLDER, _TORCH_FOLDER = (os.path.dirname(m.__file__) + os.sep for m in (ddp_strategy, torch))


class CheckFailed(Exception):
    """A check's expectation not met; the message is the check's FAIL line."""


def expect(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition``."""
    if not condition:
        raise CheckFailed(message)


def quiet_trainer(strategy: Any, callbacks: list[Callback], accelerator: str, **overrides: Any) -> L.Trainer:
    """One device, 5 epochs, ``deterministic=True``; no logger, progress bar, model summary or checkpointing
    (``overrides`` win)."""
    settings: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": 1,
        "strategy": strategy,
        "max_epochs": 5,
        "deterministic": True,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks,
    }
    return L.Trainer(**{**settings, **overrides})


class Probe(Callback):
    """Records what the strategy set up when training starts, the dtype of the model's training output, and the
    model's logits for ``inputs`` (on the device, before teardown moves the model to the CPU) when training ends.

    Args:
        inputs: images (N, 64) float32 on the CPU whose logits (N, 10) to keep in :attr:`logits`; None: none.
    """

    def __init__(self, inputs: Tensor | None = None) -> None:
        self.inputs = inputs
        self.seen: dict[str, Any] = {}
        self.output_dtype: str | None = None
        self.logits: Tensor | None = None
        self._hook: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        wrapper = trainer.strategy.model
        self.seen = {
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": str(trainer.strategy.root_device),
            "ddp": isinstance(wrapper, DistributedDataParallel),
            "device_ids": getattr(wrapper, "device_ids", None),
            "param_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "batchnorms": sorted({type(m).__name__ for m in pl_module.modules() if isinstance(m, _BatchNorm)}),
        }
        self._hook = pl_module.register_forward_hook(self._record_dtype)

    def _record_dtype(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training and self.output_dtype is None and isinstance(output, Tensor):
            self.output_dtype = str(output.dtype)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._hook.remove()
        if self.inputs is not None:
            with torch.no_grad():
                self.logits = pl_module(self.inputs.to(pl_module.device)).float().cpu()


class BytesPerStep(Callback):
    """Counts what the registered comm hook all-reduces in each training step
    (:func:`ddp_strategy.count_collective_bytes`): :attr:`steps` holds ``(bytes, dtype names)`` per step."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[str]]] = []
        self.losses: list[Tensor] = []
        self._open = contextlib.ExitStack()
        self._counts: Any = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._counts = self._open.enter_context(count_collective_bytes())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._open.close()
        self.steps.append((self._counts.bytes_sent, sorted(self._counts.by_dtype)))
        self.losses.append(outputs["loss"].detach())


class SyncDebugWindow(Callback):
    """``torch.cuda.set_sync_debug_mode("error")`` from the end of step ``warmup - 1`` to the end of step
    ``warmup + checked - 1``, so ``checked`` whole steady-state steps (the loop's work between steps, the batch's
    transfer and the strategy's hooks included) raise at any host-device sync. Set back to ``"default"`` at the
    window's end and in ``on_exception``, which Lightning calls before the strategy's own exception handling."""

    def __init__(self, warmup: int, checked: int) -> None:
        self.first, self.last = warmup, warmup + checked - 1
        self.done: int | None = None  # the last step that ended, counted from 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.done = trainer.global_step - 1
        if self.done == self.first - 1:
            torch.cuda.set_sync_debug_mode("error")
        elif self.done == self.last:
            torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        torch.cuda.set_sync_debug_mode("default")

    @property
    def steps_checked(self) -> int:
        """Steady-state steps that ended inside the window."""
        return 0 if self.done is None else max(0, min(self.done, self.last) - self.first + 1)


@dataclass
class Fit:
    """One fit of a check: its label, Trainer, module, data (a ``LightningDataModule`` or a training
    ``DataLoader``), its :class:`Probe` and any other callback the check reads."""

    name: str
    trainer: L.Trainer
    module: L.LightningModule
    data: Any
    probe: Probe
    watch: Any = None
    error: BaseException | None = field(default=None, repr=False)

    def run(self, catch: bool = False) -> None:
        """Fit, after clearing what an earlier fit in this process left (its process group and ``MASTER_PORT``:
        Lightning's ``ddp`` keeps both) and reseeding; ``catch``: keep an exception in :attr:`error` instead."""
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)
        L.seed_everything(SEED, verbose=False)
        try:
            if isinstance(self.data, DataLoader):
                self.trainer.fit(self.module, train_dataloaders=self.data)
            else:
                self.trainer.fit(self.module, datamodule=self.data)
        except Exception as e:
            if not catch:
                raise
            self.error = e


def _seeded(make: Callable[[], Any]) -> Any:
    """``make()`` after ``seed_everything``: the same initial weights for each strategy."""
    L.seed_everything(SEED, verbose=False)
    return make()


def validation_images() -> tuple[Tensor, Tensor]:
    """The digits validation split: images (359, 64) float32 and labels (359,) int64, on the CPU."""
    data = DigitsDataModule()
    data.setup("fit")
    return data.val_set.tensors


class BatchNormDigits(DigitsClassifier):
    """The reference classifier with a BatchNorm layer: 64 -> 128 -> BatchNorm1d -> ReLU -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


# ----------------------------------------------------------------------------------------------------------- plans
def plan_fit(accelerator: str, folder: Path) -> list[Fit]:
    """The reference model under each strategy, a checkpoint written at each epoch's end into ``folder``."""
    fits = []
    for name, make in STRATEGIES:
        saving = ModelCheckpoint(dirpath=folder / name.replace(" ", "_"))
        probe = Probe(validation_images()[0])
        trainer = quiet_trainer(make(), [probe, saving], accelerator, enable_checkpointing=True)
        fits.append(Fit(name, trainer, _seeded(DigitsClassifier), DigitsDataModule(), probe, saving))
    return fits


def plan_bf16(accelerator: str, folder: Path) -> list[Fit]:
    """The reference model under each strategy with ``precision="bf16-mixed"``."""
    fits = []
    for name, make in STRATEGIES:
        probe = Probe()
        trainer = quiet_trainer(make(), [probe], accelerator, precision="bf16-mixed")
        fits.append(Fit(name, trainer, _seeded(DigitsClassifier), DigitsDataModule(), probe))
    return fits


def plan_sync_bn(accelerator: str, folder: Path) -> list[Fit]:
    """:class:`BatchNormDigits` under each strategy with ``sync_batchnorm=True``."""
    fits = []
    for name, make in STRATEGIES:
        probe = Probe()
        trainer = quiet_trainer(make(), [probe], accelerator, sync_batchnorm=True)
        fits.append(Fit(name, trainer, _seeded(BatchNormDigits), DigitsDataModule(), probe))
    return fits


def plan_comm_hooks(accelerator: str, folder: Path) -> list[Fit]:
    """The reference model under ``MyDDPStrategy(ddp_comm_hook=...)`` for each of :data:`COMM_HOOKS`, 30 steps."""
    fits = []
    for hook in COMM_HOOKS:
        probe, counting = Probe(), BytesPerStep()
        trainer = quiet_trainer(
            MyDDPStrategy(ddp_comm_hook=hook), [probe, counting], accelerator, max_steps=30, limit_val_batches=0
        )
        fits.append(Fit(hook, trainer, _seeded(DigitsClassifier), DigitsDataModule(), probe, counting))
    return fits


def plan_sync_debug(accelerator: str, folder: Path) -> list[Fit]:
    """``BenchModule`` (the small MLP, SGD, no ``self.log``) under each strategy, MyDDPStrategy first, with a
    :class:`SyncDebugWindow`; the defaults a user has (``deterministic=False``)."""
    workload = WORKLOADS["small"]  # 2048 samples of batch 32: the window lies inside the first epoch
    fits = []
    for name, make in reversed(STRATEGIES):
        probe, window = Probe(), SyncDebugWindow(SYNC_WARMUP_STEPS, SYNC_CHECKED_STEPS)
        trainer = quiet_trainer(
            make(), [probe, window], accelerator, max_steps=window.last + 2, max_epochs=-1, deterministic=False
        )
        loader = DataLoader(build_dataset(workload, SEED), batch_size=workload.batch, shuffle=True)
        fits.append(Fit(name, trainer, BenchModule(workload, SEED), loader, probe, window))
    return fits


# ---------------------------------------------------------------------------------------------------------- checks
def _expect_nccl_on_the_gpu(fit: Fit) -> None:
    seen = fit.probe.seen
    expect(
        seen.get("backend") == "nccl" and seen["device"] == "cuda:0" and seen["ddp"] and seen["device_ids"] == [0],
        f"{fit.name}: expected nccl on cuda:0, DDP-wrapped with device_ids [0]; found {seen or 'no training start'}",
    )


def _val_acc(fit: Fit) -> float:
    acc = float(fit.trainer.callback_metrics["val_acc"])
    expect(acc > MIN_VAL_ACC, f"{fit.name}: val_acc {acc:.3f} after 5 epochs, expected > {MIN_VAL_ACC}")
    return acc


def compare(ours: dict[str, Tensor], theirs: dict[str, Tensor], what: str, atol: float = SAME_WEIGHTS_ATOL) -> str:
    """``"bitwise equal"`` or ``"largest difference 3.1e-07"``: the largest absolute difference of the state dicts'
    tensors, compared on the CPU in float64; :class:`CheckFailed` for other keys or a difference over ``atol``."""
    expect(ours.keys() == theirs.keys(), f"{what}: keys differ: {sorted(ours.keys() ^ theirs.keys())}")
    largest = max(
        (ours[k].detach().cpu().double() - theirs[k].detach().cpu().double()).abs().max().item() for k in ours
    )
    expect(largest <= atol, f"{what}: largest difference {largest:.2e} > {atol:g}")
    return "bitwise equal" if largest == 0 else f"largest difference {largest:.1e}"


def check_fit(fits: list[Fit]) -> str:
    """Each fit: NCCL on cuda:0, accuracy; its last checkpoint loads on the CPU into ``DigitsNet`` with the trained
    weights and predicts as the model did on the GPU. Then MyDDPStrategy's weights against Lightning's ``ddp``."""
    images, labels = validation_images()
    accuracy = []
    for fit in fits:
        fit.run()
        _expect_nccl_on_the_gpu(fit)
        accuracy.append(f"{_val_acc(fit):.3f}")
        state = load_plain_state_dict(fit.watch.best_model_path)
        expect(
            all(t.device.type == "cpu" for t in state.values()), f"{fit.name}: load_plain_state_dict gave GPU tensors"
        )
        plain = DigitsNet()
        plain.load_state_dict(state)  # strict: the same keys as the plain module
        compare(plain.state_dict(), fit.module.model.state_dict(), f"{fit.name}: checkpoint vs trained weights", 0.0)
        with torch.no_grad():
            predicted = plain(images).argmax(1)
        agree = (predicted == fit.probe.logits.argmax(1)).float().mean().item()
        expect(agree >= 0.99, f"{fit.name}: DigitsNet on the CPU agrees with the GPU model on {agree:.1%} only")
        accuracy[-1] += f" (CPU {(predicted == labels).float().mean().item():.3f})"
    same = compare(fits[1].module.state_dict(), fits[0].module.state_dict(), "MyDDPStrategy vs Lightning ddp")
    return (
        f"nccl, cuda:0, device_ids [0]; val_acc ddp {accuracy[0]}, ours {accuracy[1]}; each checkpoint loads on the CPU"
        f" into DigitsNet with the trained weights and the GPU's predictions; MyDDPStrategy vs ddp weights: {same}"
    )


def check_bf16(fits: list[Fit]) -> str:
    """Each fit: bfloat16 forward under autocast, float32 parameters, accuracy; then the two strategies' weights."""
    accuracy = []
    for fit in fits:
        fit.run()
        _expect_nccl_on_the_gpu(fit)
        found = (fit.probe.output_dtype, fit.probe.seen["param_dtypes"])
        expect(
            found == ("torch.bfloat16", ["torch.float32"]),
            f"{fit.name}: expected bfloat16 logits and float32 parameters, found {found}",
        )
        accuracy.append(f"{_val_acc(fit):.3f}")
    same = compare(fits[1].module.state_dict(), fits[0].module.state_dict(), "MyDDPStrategy vs Lightning ddp")
    return (
        f"bfloat16 logits, float32 parameters; val_acc ddp {accuracy[0]}, ours {accuracy[1]}; MyDDPStrategy vs ddp"
        f" weights: {same}"
    )


def check_sync_bn(fits: list[Fit]) -> str:
    """Each fit: torch's ``SyncBatchNorm`` while fitting, BatchNorm again after, running statistics updated."""
    accuracy = []
    for fit in fits:
        fit.run()
        _expect_nccl_on_the_gpu(fit)
        after = sorted({type(m).__name__ for m in fit.module.modules() if isinstance(m, _BatchNorm)})
        expect(
            fit.probe.seen["batchnorms"] == ["SyncBatchNorm"] and "SyncBatchNorm" not in after,
            f"{fit.name}: BatchNorm layers {fit.probe.seen['batchnorms']} while fitting, {after} after;"
            " expected SyncBatchNorm, then BatchNorm again",
        )
        expect(bool(fit.module.model[1].running_mean.abs().sum() > 0), f"{fit.name}: running_mean never updated")
        accuracy.append(f"{_val_acc(fit):.3f}")
    expect(type(fits[1].module.model[1]) is nn.BatchNorm1d, "MyDDPStrategy: not reverted to BatchNorm1d")
    same = compare(fits[1].module.state_dict(), fits[0].module.state_dict(), "MyDDPStrategy vs Lightning ddp")
    return (
        f"torch.nn.SyncBatchNorm while fitting, BatchNorm1d after (ours), running stats updated; val_acc ddp"
        f" {accuracy[0]}, ours {accuracy[1]}; weights and buffers: {same} (world size 1: torch's SyncBatchNorm"
        " computes this rank's statistics, nothing to all-reduce)"
    )


def check_comm_hooks(fits: list[Fit]) -> str:
    """fp16: every step all-reduces 2 bytes per parameter in float16. PowerSGD: 4 bytes per parameter in float32 for
    its first :data:`POWERSGD_PLAIN_STEPS` steps, then under half that. Losses finite."""
    summary = []
    for fit in fits:
        fit.run()
        _expect_nccl_on_the_gpu(fit)
        parameters = sum(p.numel() for p in fit.module.parameters())
        steps, losses = fit.watch.steps, torch.stack(fit.watch.losses)
        expect(len(steps) == 30 and bool(torch.isfinite(losses).all()), f"{fit.name}: {len(steps)} steps, {losses}")
        if fit.name == "fp16":
            expect(
                all(step == (2 * parameters, ["torch.float16"]) for step in steps),
                f"fp16: expected {2 * parameters} bytes of float16 per step, found {sorted(set(map(str, steps)))}",
            )
            summary.append(f"fp16 {2 * parameters} bytes of float16 per step")
            continue
        plain, compressed = steps[:POWERSGD_PLAIN_STEPS], steps[POWERSGD_PLAIN_STEPS:]
        expect(
            all(step == (4 * parameters, ["torch.float32"]) for step in plain)
            and all(0 < b < 2 * parameters for b, _ in compressed),
            f"powersgd: expected {4 * parameters} bytes per step for {POWERSGD_PLAIN_STEPS} steps, then under"
            f" {2 * parameters}; found {[b for b, _ in steps]}",
        )
        summary.append(f"powersgd {plain[0][0]} bytes per step, from step {POWERSGD_PLAIN_STEPS} {compressed[-1][0]}")
    return f"on NCCL, {parameters} parameters: " + "; ".join(summary) + "; losses finite"


def place(error: BaseException) -> str:
    """Where ``error`` was raised, as ``file:line function`` (the path's last 3 parts): its innermost frame outside
    torch, followed by ``(through <the innermost frame in ddp_strategy>)`` when the strategy called that code (the
    user's ``training_step``, say) rather than raised in it."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    innermost = ([f for f in frames if not f.filename.startswith(_TORCH_FOLDER)] or frames)[-1]
    ours = [f for f in frames if f.filename.startswith(_PACKAGE_FOLDER)]
    through = f" (through {_frame(ours[-1])})" if ours and ours[-1] is not innermost else ""
    return _frame(innermost) + through


def _frame(frame: traceback.FrameSummary) -> str:
    return f"{'/'.join(Path(frame.filename).parts[-3:])}:{frame.lineno} {frame.name}"


def sync_site(error: BaseException) -> str | None:
    """Where a synchronizing CUDA operation was called (:func:`place` of the first exception in ``error``'s chain
    with torch's sync-debug message); None: no such exception."""
    seen: BaseException | None = error
    while seen is not None and SYNC_ERROR not in str(seen):
        seen = seen.__cause__ or seen.__context__
    return None if seen is None else place(seen)


def check_sync_debug(fits: list[Fit]) -> str:
    """MyDDPStrategy, then Lightning's ``ddp`` for comparison: :data:`SYNC_CHECKED_STEPS` steady-state steps under
    ``set_sync_debug_mode("error")``; a sync raises and is named by :func:`sync_site`."""
    found = {}
    for fit in fits:
        fit.run(catch=True)
        site = None if fit.error is None else sync_site(fit.error)
        if fit.error is not None and site is None:
            raise fit.error  # failed for another reason: reported with its own place
        checked = fit.watch.steps_checked
        found[fit.name] = (
            f"a host-device sync in steady-state step {fit.watch.done + 1} at {site}"
            if site
            else f"no host-device sync in {checked} steady-state steps"
        )
        expect(site is not None or checked == SYNC_CHECKED_STEPS, f"{fit.name}: only {checked} steps were checked")
    ours, theirs = found["MyDDPStrategy"], found["Lightning ddp"]
    expect(ours.startswith("no "), f"MyDDPStrategy: {ours} (Lightning ddp: {theirs})")
    return f"MyDDPStrategy: {ours} under set_sync_debug_mode('error'); Lightning ddp: {theirs}"


#: Part name -> (plan, check), in the order gpu_check.py runs them.
CHECKS: dict[str, tuple[Callable[[str, Path], list[Fit]], Callable[[list[Fit]], str]]] = {
    "fit": (plan_fit, check_fit),
    "bf16": (plan_bf16, check_bf16),
    "sync-bn": (plan_sync_bn, check_sync_bn),
    "comm-hooks": (plan_comm_hooks, check_comm_hooks),
    "sync-debug": (plan_sync_debug, check_sync_debug),
}
