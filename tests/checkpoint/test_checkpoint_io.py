"""Checkpoint keys, atomic writes, safe loads, plain-PyTorch import and weight export, in one process."""

from __future__ import annotations

import copy
import os
import pathlib
import random
import signal
import stat
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import quiet_trainer
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy import (
    DamagedCheckpointError,
    DDPCheckpointIO,
    DigitsClassifier,
    DigitsDataModule,
    DigitsNet,
    MyDDPStrategy,
    StateDictMismatchError,
    UnsafeCheckpointError,
    export_weights,
    import_plain_checkpoint,
    load_plain_state_dict,
    match_state_dict,
    strip_ddp_prefix,
    unwrapped_state_dict,
)
from ddp_strategy.checkpoint.io import atomic_save, load_file, remove_stale_temp_files

PLAIN_KEYS = set(DigitsNet().state_dict())
LIGHTNING_KEYS = {f"model.{k}" for k in PLAIN_KEYS}


def _prefixed(state_dict, prefix="module."):
    return {f"{prefix}{k}": v for k, v in state_dict.items()}


class HasChildCalledModule(nn.Module):
    """A model whose only child is really called ``module``: its keys must keep that name."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 2)


def test_unwrapped_keys_are_identical_for_compiled_and_ddp_variants(world_of_one):
    """Compiled sub-module, compiled whole model, DDP(compile) and compile(DDP) all give the plain keys."""
    lm = DigitsClassifier()
    lm.model = torch.compile(lm.model, backend="eager")
    assert any("_orig_mod" in k for k in lm.state_dict())
    assert set(unwrapped_state_dict(lm)) == LIGHTNING_KEYS
    assert set(unwrapped_state_dict(torch.compile(DigitsClassifier(), backend="eager"))) == LIGHTNING_KEYS
    assert set(unwrapped_state_dict(torch.compile(DigitsNet(), backend="eager"))) == PLAIN_KEYS
    ddp_of_compiled = DistributedDataParallel(torch.compile(DigitsNet(), backend="eager"))
    compiled_ddp = torch.compile(DistributedDataParallel(DigitsNet()), backend="eager")
    assert next(iter(ddp_of_compiled.state_dict())).startswith("module._orig_mod.")
    assert next(iter(compiled_ddp.state_dict())).startswith("_orig_mod.module.")
    assert set(unwrapped_state_dict(ddp_of_compiled)) == set(unwrapped_state_dict(compiled_ddp)) == PLAIN_KEYS


def test_real_child_called_module_keeps_its_name(world_of_one):
    """``module.weight`` of a real child stays; under DDP only the wrapper's own ``module.`` goes."""
    model = HasChildCalledModule()
    assert set(unwrapped_state_dict(model)) == {"module.weight", "module.bias"}
    assert set(unwrapped_state_dict(DistributedDataParallel(model))) == {"module.weight", "module.bias"}
    # loading: a DDP file (module.module.*) and a plain file (module.*) both map onto the real child
    for keys in (_prefixed(model.state_dict()), model.state_dict()):
        assert set(match_state_dict(keys, model)) == {"module.weight", "module.bias"}


def test_match_accepts_all_prefix_variants_into_plain_and_compiled_models():
    """Files with module./_orig_mod. keys load exactly into DigitsClassifier, compiled or not."""
    source = DigitsClassifier()
    plain_keys = source.state_dict()
    variants = [
        plain_keys,
        _prefixed(plain_keys),
        _prefixed(plain_keys, "_orig_mod.module."),
        {k.replace("model.", "model._orig_mod.", 1): v for k, v in plain_keys.items()},
    ]
    compiled = DigitsClassifier()
    compiled.model = torch.compile(compiled.model, backend="eager")
    for state_dict in variants:
        for target in (DigitsClassifier(), compiled):
            target.load_state_dict(match_state_dict(state_dict, target), strict=True)
            x = torch.rand(4, 64)
            torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_mismatch_lists_missing_and_unexpected_keys(tmp_path):
    """One error names the file and lists the missing key, the unexpected key and a shape mismatch."""
    state_dict = dict(DigitsClassifier().state_dict())
    state_dict.pop("model.layers.4.bias")
    state_dict["model.extra.weight"] = torch.zeros(1)
    state_dict["model.layers.0.weight"] = torch.zeros(3, 3)
    with pytest.raises(StateDictMismatchError) as info:
        match_state_dict(state_dict, DigitsClassifier(), source=tmp_path / "x.ckpt")
    message = str(info.value)
    assert "x.ckpt" in message and "'model.layers.4.bias'" in message and "'model.extra.weight'" in message
    assert "strict_loading = False" in message
    assert "size mismatch for model.layers.0.weight: (3, 3) in the file, (128, 64) in the model" in message
    assert info.value.missing == ["model.layers.4.bias"] and info.value.unexpected == ["model.extra.weight"]
    loose = match_state_dict(state_dict, DigitsClassifier(), strict=False)  # as torch's strict=False: keys only
    assert set(loose) == LIGHTNING_KEYS - {"model.layers.4.bias"} and loose["model.layers.0.weight"].shape == (3, 3)


def test_strip_ddp_prefix_heuristic_without_a_model():
    """Without a model, ``module.`` goes only when every key carries it."""
    assert list(strip_ddp_prefix({"module.a.weight": 1, "module.b": 2})) == ["a.weight", "b"]
    mixed = {"module.weight": 1, "head.weight": 2}
    assert strip_ddp_prefix(mixed) == mixed


def test_io_saves_the_keys_given_and_loads_weights_only(tmp_path):
    """DDPCheckpointIO writes the keys it is given (as TorchCheckpointIO), leaves no temporary file and loads with
    weights_only=True."""
    model = DigitsClassifier()
    path = tmp_path / "sub" / "c.ckpt"
    DDPCheckpointIO().save_checkpoint({"state_dict": model.state_dict(), "epoch": 3}, path)
    assert os.listdir(path.parent) == ["c.ckpt"]
    saved = DDPCheckpointIO().load_checkpoint(path)
    assert set(saved["state_dict"]) == LIGHTNING_KEYS and saved["epoch"] == 3


class CompiledDigits(DigitsClassifier):
    """DigitsClassifier whose plain model is compiled (eager backend, so it runs on CPU without a compiler)."""

    def __init__(self) -> None:
        super().__init__(hidden_size=8)
        self.model = torch.compile(self.model, backend="eager")


def _fit_compiled(root: pathlib.Path, ours: bool, max_steps: int, ckpt_path: pathlib.Path | None = None) -> pl.Trainer:
    """Fit a CompiledDigits on one device, saving a checkpoint in ``root``, under MyDDPStrategy (``ours``) or under
    Lightning's own strategy with DDPCheckpointIO as its plugin."""
    trainer = quiet_trainer(
        1,
        MyDDPStrategy(timeout=30) if ours else "auto",
        plugins=[] if ours else [DDPCheckpointIO()],
        max_steps=max_steps,
        limit_val_batches=0,
        enable_checkpointing=True,
        default_root_dir=root,
    )
    trainer.fit(CompiledDigits(), DigitsDataModule(), ckpt_path=ckpt_path)
    return trainer


def test_compiled_keys_are_cleaned_by_the_strategy_and_kept_by_the_plugin_alone(tmp_path):
    """MyDDPStrategy saves a compiled model's checkpoint with the plain keys (its lightning_module_state_dict),
    and it resumes into the compiled model; DDPCheckpointIO alone, under Lightning's own strategy, writes the keys
    as given, as TorchCheckpointIO does, so that fit resumes too (until 0.2 the plugin removed _orig_mod. itself,
    and Lightning's strategy could not load such a file back: docs/differences.md, checkpoint keys)."""
    compiled_keys = {k.replace("model.", "model._orig_mod.", 1) for k in LIGHTNING_KEYS}
    for ours, keys in ((True, LIGHTNING_KEYS), (False, compiled_keys)):
        root = tmp_path / str(ours)
        _fit_compiled(root, ours, max_steps=2)
        (path,) = (root / "checkpoints").iterdir()
        assert set(torch.load(path, weights_only=True)["state_dict"]) == keys, ours
        assert _fit_compiled(root, ours, max_steps=3, ckpt_path=path).global_step == 3, ours


def test_a_file_url_is_saved_where_lightnings_io_saves_it(tmp_path, monkeypatch):
    """``file:///abs/c.ckpt`` means /abs/c.ckpt, as for Lightning's TorchCheckpointIO (fsspec), not a folder
    ``file:`` in the working directory; it loads back from there."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    monkeypatch.chdir(tmp_path)
    for io, name in ((TorchCheckpointIO(), "lightning.ckpt"), (DDPCheckpointIO(), "ours.ckpt")):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, f"file://{tmp_path / name}")
        assert (tmp_path / name).is_file() and not (tmp_path / "file:").exists(), name
        assert io.load_checkpoint(f"file://{tmp_path / name}")["epoch"] == 1


def test_weights_only_refuses_foreign_objects_with_a_clear_error(tmp_path):
    """An object outside the allow-list is refused by default, named, and loads with an explicit opt-out."""
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "where": pathlib.PurePosixPath("/x")}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"foreign.ckpt .*PurePosixPath.*weights_only=False"):
        DDPCheckpointIO().load_checkpoint(path)
    assert DDPCheckpointIO().load_checkpoint(path, weights_only=False)["where"] == pathlib.PurePosixPath("/x")
    assert DDPCheckpointIO(weights_only=False).load_checkpoint(path)["where"] == pathlib.PurePosixPath("/x")


def test_missing_truncated_and_garbage_files_give_clear_errors(tmp_path):
    """A missing file names its path; truncated, empty and random (seeded) files are reported as damaged."""
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        load_file(tmp_path / "nope.ckpt")
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": nn.Linear(64, 64).state_dict()}, good)
    cases = {
        "truncated.ckpt": good.read_bytes()[:200],
        "empty.ckpt": b"",
        "garbage.ckpt": random.Random(0).randbytes(4096),
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DamagedCheckpointError, match=rf"{name} is damaged"):
            DDPCheckpointIO().load_checkpoint(tmp_path / name)
    with pytest.raises(DamagedCheckpointError, match=r"truncated.ckpt is damaged"):
        load_plain_state_dict(tmp_path / "truncated.ckpt")


_WRITER = """
import io, sys, time, torch
from ddp_strategy.checkpoint.io import atomic_save
path, ready, halfway = sys.argv[1], sys.argv[2], sys.argv[3]
big = {"state_dict": {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(16)}}  # 16 x 4 MiB
atomic_save({"version": 1, **big}, path)
open(ready, "w").close()

def half_then_wait(obj, f):  # torch.save's bytes, cut off half-way: the kill lands mid-write, every run
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    f.write(buffer.getvalue()[: buffer.tell() // 2])
    f.flush()
    open(halfway, "w").close()
    time.sleep(600)

atomic_save({"version": 2, **big}, path, save_fn=half_then_wait)
"""


def _wait_for_file(marker: pathlib.Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, f"the writer exited ({proc.returncode}) before {marker.name}"
        assert time.monotonic() < deadline, f"{marker.name} did not appear within {timeout_s} s"
        time.sleep(0.01)


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    """A writer killed (SIGKILL) half-way through a 64 MiB save leaves the previous checkpoint; its temp file goes."""
    path, ready, halfway = tmp_path / "ckpts" / "last.ckpt", tmp_path / "ready", tmp_path / "halfway"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(ready), str(halfway)], env=env)
    try:
        _wait_for_file(ready, proc)
        _wait_for_file(halfway, proc)  # the second save has written half its bytes and waits: kill it there
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    leftovers = [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 1 << 20  # the half-written second save
    assert all(p.name.startswith(".last.ckpt.") for p in leftovers)  # hidden, never *.ckpt
    checkpoint = load_file(path)
    assert checkpoint["version"] == 1 and len(checkpoint["state_dict"]) == 16
    assert torch.equal(checkpoint["state_dict"]["w15"], torch.full((1024, 1024), 15.0))
    assert set(remove_stale_temp_files(path.parent)) == set(leftovers)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_the_next_save_removes_what_dead_writers_on_this_host_left(tmp_path):
    """A temporary file whose writer died on this host goes at the next save into its folder; one of a live writer
    or of another host (a shared file system) stays, and so does the file the save replaces."""
    names = []

    def recording(obj, f):
        names.append(pathlib.Path(f.name).name)
        torch.save(obj, f)

    atomic_save({"a": 1}, tmp_path / "c.pt", save_fn=recording)
    _, target, ext, host, pid, token, tmp = names[0].split(".")  # .c.pt.<host>.<pid>.<token>.tmp
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    dead, live, elsewhere = (
        f".{target}.{ext}.{h}.{p}.{token}.{tmp}"
        for h, p in ((host, finished.pid), (host, os.getppid()), ("other-host", finished.pid))
    )
    for name in (dead, live, elsewhere):
        (tmp_path / name).write_bytes(b"half a checkpoint")
    atomic_save({"a": 2}, tmp_path / "c.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.pt", live, elsewhere])
    assert load_file(tmp_path / "c.pt") == {"a": 2}


def test_atomic_save_removes_its_temp_file_on_error(tmp_path):
    """A save that fails half-way leaves the old file and no temporary file."""
    path = tmp_path / "c.pt"
    atomic_save({"a": 1}, path)

    def failing(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save({"a": 2}, path, save_fn=failing)
    assert os.listdir(tmp_path) == ["c.pt"] and load_file(path) == {"a": 1}


# ------------------------------------------------------------------------- plain PyTorch checkpoints
@pytest.fixture
def hand_made_ddp_checkpoint(tmp_path, world_of_one):
    """What a hand-written DDP script saves after 2 epochs of 3 Adam steps: module.-prefixed keys."""
    torch.manual_seed(0)
    net = DigitsNet()
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    x, y = torch.rand(6, 64), torch.randint(0, 10, (6,))
    for _ in range(6):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    path = tmp_path / "ddp_script.pt"
    torch.save({"epoch": 2, "model_state_dict": ddp.state_dict(), "optimizer_state_dict": optimizer.state_dict()}, path)
    return path, net, optimizer


class _RecordStart(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = (
            trainer.current_epoch,
            trainer.global_step,
            {k: v.clone() for k, v in pl_module.state_dict().items()},
            copy.deepcopy(trainer.optimizers[0].state_dict()),
        )


def test_hand_made_ddp_checkpoint_loads_and_resumes_in_lightning(hand_made_ddp_checkpoint, tmp_path):
    """A plain DDP file loads strictly into DigitsNet and DigitsClassifier and resumes with Trainer.fit."""
    path, net, optimizer = hand_made_ddp_checkpoint
    x = torch.rand(5, 64)
    plain = DigitsNet()
    import_plain_checkpoint(path, plain)
    torch.testing.assert_close(plain(x), net(x), rtol=0, atol=0)
    model = DigitsClassifier()
    out = tmp_path / "imported.ckpt"
    import_plain_checkpoint(path, model, out)
    torch.testing.assert_close(model(x), net(x), rtol=0, atol=0)

    recorder = _RecordStart()
    trainer = quiet_trainer(
        1,
        "auto",
        max_epochs=3,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[recorder],
        default_root_dir=tmp_path,
    )
    trainer.fit(DigitsClassifier(), DigitsDataModule(), ckpt_path=out)
    epoch, step, weights, opt_state = recorder.start
    assert epoch == 2 and trainer.current_epoch == 3 and trainer.global_step == 2
    for key, value in net.state_dict().items():
        assert torch.equal(weights[f"model.{key}"], value)
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(opt_state["state"][index]["exp_avg"], state["exp_avg"])
        assert opt_state["state"][index]["step"] == state["step"] == 6


def test_import_reports_mismatched_keys_and_misaligned_optimizer(hand_made_ddp_checkpoint, tmp_path):
    """A file for another architecture, or an optimizer over other parameters, gives a clear error."""
    path, _, _ = hand_made_ddp_checkpoint
    with pytest.raises(StateDictMismatchError, match=r"ddp_script.pt does not fit DigitsClassifier"):
        import_plain_checkpoint(path, DigitsClassifier(hidden_size=16))
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["optimizer_state_dict"]["param_groups"][0]["params"].reverse()
    with pytest.raises(ValueError, match="does not line up"):
        import_plain_checkpoint(checkpoint, DigitsClassifier(), tmp_path / "x.ckpt")


def test_export_weights_as_torch_and_safetensors(tmp_path):
    """Exported weights load into DigitsNet with torch alone (and with safetensors when installed)."""
    model = DigitsClassifier()
    model.model = torch.compile(model.model, backend="eager")
    ckpt = tmp_path / "c.ckpt"
    DDPCheckpointIO().save_checkpoint({"state_dict": model.state_dict()}, ckpt)
    x = torch.rand(3, 64)
    for source in (ckpt, model):
        export_weights(source, tmp_path / "w.pt")
        net = DigitsNet()
        net.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True), strict=True)
        torch.testing.assert_close(net(x), model(x), rtol=0, atol=0)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    export_weights(ckpt, tmp_path / "w.safetensors")
    net = DigitsNet()
    net.load_state_dict(safetensors_torch.load_file(tmp_path / "w.safetensors"), strict=True)
    torch.testing.assert_close(net(x), model(x), rtol=0, atol=0)


class TiedLM(nn.Module):
    """A language model whose output layer is its embedding (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``),
    with two empty buffers, which share no memory (address 0) and are not tied."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 4)
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("empty_a", torch.empty(0))
        self.register_buffer("empty_b", torch.empty(0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.wte(ids))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_exported_tied_weights_load_back_into_the_tied_model(tmp_path, device):
    """A checkpoint of a model with tied weights (and the model itself, on the CPU or a GPU) exports to safetensors
    (which refuses shared memory) with the tied tensor written once, under its first name, the other name in the
    metadata: safetensors.torch.load_model, as the docs say, loads it into a fresh model, the tie kept; the
    PyTorch file keeps both names and loads with load_state_dict; the returned state dict holds both."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    holder = pl.LightningModule()
    holder.model = TiedLM().to(device)
    ckpt = tmp_path / "tied.ckpt"
    DDPCheckpointIO().save_checkpoint({"state_dict": holder.state_dict()}, ckpt)
    ids = torch.tensor([[1, 5, 10]])
    expected = holder.model.cpu()(ids) if device == "cpu" else holder.model(ids.to(device)).cpu()
    for source in (ckpt, holder):
        returned = export_weights(source, tmp_path / "w.safetensors")
        assert sorted(returned) == ["empty_a", "empty_b", "lm_head.weight", "wte.weight"]
        with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
            assert sorted(f.keys()) == ["empty_a", "empty_b", "wte.weight"]
            assert f.metadata() == {"lm_head.weight": "wte.weight"}
        torch.manual_seed(1)
        net = TiedLM()
        safetensors_torch.load_model(net, tmp_path / "w.safetensors")
        assert net.lm_head.weight is net.wte.weight
        torch.testing.assert_close(net(ids), expected, rtol=0, atol=0)

        export_weights(source, tmp_path / "w.pt")
        net = TiedLM()
        net.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True), strict=True)
        assert net.lm_head.weight is net.wte.weight
        torch.testing.assert_close(net(ids), expected, rtol=0, atol=0)


def test_atomic_save_gives_the_permissions_a_plain_save_gives(tmp_path):
    """A checkpoint written atomically is readable by whoever could read torch.save's file (0o644 under umask
    022, 0o640 under 027), not private to its owner as the temporary file mkstemp makes (0o600)."""
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            atomic_save({"w": torch.zeros(1)}, tmp_path / f"atomic_{umask:o}.ckpt")
            torch.save({"w": torch.zeros(1)}, tmp_path / f"plain_{umask:o}.ckpt")
        finally:
            os.umask(old)
        for name in (f"atomic_{umask:o}.ckpt", f"plain_{umask:o}.ckpt"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name


def test_a_wrapping_checkpoint_plugin_without_its_own_io_wraps_ours(tmp_path):
    """plugins=[AsyncCheckpointIO()] (no inner plugin), as under Lightning's ddp: it saves through DDPCheckpointIO,
    and the file it wrote in the background loads with plain keys."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from ddp_strategy import DDPCheckpointIO, MyDDPStrategy

    trainer = quiet_trainer(
        1,
        MyDDPStrategy(),
        enable_checkpointing=True,
        plugins=[AsyncCheckpointIO()],
        max_steps=2,
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    assert isinstance(trainer.strategy.checkpoint_io.checkpoint_io, DDPCheckpointIO)
    (path,) = (tmp_path / "checkpoints").iterdir()
    assert set(torch.load(path, weights_only=True)["state_dict"]) == {"layer.weight", "layer.bias"}
