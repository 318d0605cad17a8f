"""Every fix an error or warning of ddp_strategy suggests works in the situation that raises it.

Each test provokes the error (or warning), then applies each suggested fix in that same situation and asserts
the value the user wanted: the fit trains its steps, the loader yields the expected batches, the file loads.
Mostly one process: ``Trainer(devices=1)`` runs in this process, and the rank-agnostic helpers are called with
``num_replicas=2`` directly; one 2-process launch (tests/error_suggestion_workers.py) covers what only 2 ranks
raise. The suggestions of UnsafeCheckpointError and StateDictMismatchError are tested in
tests/test_lightning_compat_data.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
import socket
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import free_port
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import MyDDPStrategy, export_weights, import_plain_checkpoint
from ddp_strategy.checkpoint.files import plain_state_dict
from ddp_strategy.diagnostics.summary import batch_size_warnings
from ddp_strategy.process import group as process_group
from ddp_strategy.process import launching
from ddp_strategy.process.collectives import check_gatherable
from ddp_strategy.sampling.evaluation import needs_padding, shard_for_evaluation
from ddp_strategy.sampling.injection import inject_distributed_sampler
from ddp_strategy.sampling.state import CHECKPOINT_KEY
from ddp_strategy.sync.comm_hooks import HOOKS_BY_NAME, CommHookConfig

pytestmark = pytest.mark.timeout(120)


class Regressor(pl.LightningModule):
    """``a`` is trained; ``b`` (with ``unused=True``) never takes part in the loss."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(2, 1)
        self.b = nn.Linear(2, 1) if unused else None

    def training_step(self, batch, batch_idx):
        return self.a(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.a(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n: int = 8, batch_size: int = 2, drop_last: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2, generator=torch.Generator().manual_seed(n))),
                      batch_size=batch_size, drop_last=drop_last)


def trainer(root: Path, strategy: MyDDPStrategy | None = None, **kwargs) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(devices=1, accelerator="cpu", strategy=strategy or MyDDPStrategy(timeout=30),
                      default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      **kwargs)


def fit_steps(root: Path, model: pl.LightningModule, strategy: MyDDPStrategy | None = None, **kwargs) -> int:
    """Fit 3 steps on 8 samples; return the steps taken, after checking that ``model.a`` was trained."""
    before = model.a.weight.detach().clone()
    run = trainer(root, strategy, max_steps=3, **kwargs)
    run.fit(model, loader())
    assert not torch.equal(before, model.a.weight.detach())
    return run.global_step


def error_of(run, caplog: pytest.LogCaptureFixture) -> str:
    """``run()``'s error as ``"Type: message"``, with the exception and the captured log records dropped.

    A user who reruns after an error no longer holds its traceback; pytest.raises and the log capture (the
    strategy logs the failure with its traceback) would, and with it the failed fit's rendezvous store, which
    keeps MASTER_PORT busy for the next fit in this process.
    """
    # the log record would hold the traceback (and with it the old store)
    with caplog.at_level(logging.CRITICAL + 1, logger="ddp_strategy.process.failures"):
        try:
            run()
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError("no error was raised")
    return message


# ------------------------------------------------------------------------------------------- fit errors
def test_unused_parameters_error_each_suggested_fix_trains(tmp_path, caplog):
    """'received no gradient': find_unused_parameters=True, freezing them, and static_graph=True each train 3 steps."""
    message = error_of(lambda: fit_steps(tmp_path, Regressor(unused=True)), caplog)
    assert re.match(r"RuntimeError: .* Pass MyDDPStrategy\(find_unused_parameters=True\)", message, re.S), message
    assert fit_steps(tmp_path, Regressor(unused=True), MyDDPStrategy(timeout=30, find_unused_parameters=True)) == 3
    frozen = Regressor(unused=True)
    frozen.b.requires_grad_(False)
    assert fit_steps(tmp_path, frozen) == 3
    assert fit_steps(tmp_path, Regressor(unused=True), MyDDPStrategy(timeout=30, static_graph=True)) == 3


def test_nothing_to_train_error_suggestions_work(tmp_path, caplog):
    """A frozen model: fit refuses; trainer.validate runs as suggested; after unfreezing, fit trains 3 steps."""
    model = Regressor()
    model.requires_grad_(False)
    message = error_of(lambda: trainer(tmp_path, max_steps=3).fit(model, loader()), caplog)
    wanted = "ValueError: .* Unfreeze some parameters .* or use trainer.validate/test/predict"
    assert re.match(wanted, message, re.S), message
    (metrics,) = trainer(tmp_path).validate(model, loader(), verbose=False)
    expected = torch.stack([model.a(x).pow(2).mean() for (x,) in loader()]).mean()
    assert metrics["val"] == pytest.approx(expected.item(), rel=1e-5)
    model.requires_grad_(True)
    assert fit_steps(tmp_path, model) == 3


def test_port_in_use_error_suggestions_work(tmp_path, monkeypatch):
    """MASTER_PORT taken by another process: the rendezvous error says so; another port, or none, fits."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(RuntimeError, match="Choose another MASTER_PORT, or unset it"):
            fit_steps(tmp_path, Regressor())
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        assert fit_steps(tmp_path, Regressor()) == 3
        monkeypatch.delenv("MASTER_PORT")
        assert fit_steps(tmp_path, Regressor()) == 3


def test_store_with_spawn_error_suggestions_work(tmp_path):
    """store= with start_method='spawn' is refused; 'fork' or 'popen' with a FileStore, or init_method='file://'
    with 'spawn', is accepted, and the FileStore and file:// rendezvous train in this process (popen)."""
    with pytest.raises(ValueError, match="Use start_method='fork' or 'popen'"):
        MyDDPStrategy(store=torch.distributed.FileStore(str(tmp_path / "s0"), 1), start_method="spawn")
    MyDDPStrategy(store=torch.distributed.FileStore(str(tmp_path / "s1"), 1), start_method="fork")
    popen = MyDDPStrategy(timeout=30, store=torch.distributed.FileStore(str(tmp_path / "s2"), 1), start_method="popen")
    assert fit_steps(tmp_path, Regressor(), popen) == 3
    MyDDPStrategy(init_method=f"file://{tmp_path / 'rdzv0'}", start_method="spawn")
    file_init = MyDDPStrategy(timeout=30, init_method=f"file://{tmp_path / 'rdzv1'}", start_method="popen")
    assert fit_steps(tmp_path, Regressor(), file_init) == 3


def test_unwritable_checkpoint_folder_warning_suggestions_work(tmp_path, caplog):
    """A checkpoint folder below a file warns at fit start (and the first save fails, as it says); a writable
    ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) fits without the warning and saves there."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match=r"Choose a writable ModelCheckpoint\(dirpath=...\) or Trainer\(default_root"):
        message = error_of(lambda: trainer(blocker / "root", max_steps=1, enable_checkpointing=True).fit(
            Regressor(), loader()), caplog)
    assert message.startswith("NotADirectoryError")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not writable")
        run = trainer(blocker / "root", max_steps=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")],
                      enable_checkpointing=True)
        run.fit(Regressor(), loader())
        assert [p.name for p in (tmp_path / "ckpts").iterdir()] == ["epoch=0-step=1.ckpt"]
        trainer(tmp_path / "root", max_steps=1, enable_checkpointing=True).fit(Regressor(), loader())
        assert [p.name for p in (tmp_path / "root" / "checkpoints").iterdir()] == ["epoch=0-step=1.ckpt"]


def test_changed_data_resume_error_suggestions_work(tmp_path, caplog):
    """Resuming mid-epoch with more data is refused; the suggested checkpoint saved at the end of an epoch
    resumes with the new data (8 samples -> 10: epoch 1 takes 5 steps), and the same data resumes mid-epoch."""
    mid_ck = ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=2, save_top_k=-1)
    end_ck = ModelCheckpoint(dirpath=tmp_path / "end")
    trainer(tmp_path, max_epochs=1, callbacks=[mid_ck, end_ck], enable_checkpointing=True).fit(Regressor(), loader(8))
    mid, end = tmp_path / "mid" / "epoch=0-step=2.ckpt", tmp_path / "end" / "epoch=0-step=4.ckpt"
    message = error_of(lambda: trainer(tmp_path, max_epochs=2).fit(Regressor(), loader(10), ckpt_path=mid),
                       caplog)
    assert re.match("ValueError: .* or resume from a checkpoint saved at the end of an epoch", message, re.S), message
    same = trainer(tmp_path, max_epochs=1)
    same.fit(Regressor(), loader(8), ckpt_path=mid)
    assert same.global_step == 4
    grown = trainer(tmp_path, max_epochs=2)
    grown.fit(Regressor(), loader(10), ckpt_path=end)
    assert grown.global_step == 4 + 5


def test_checkpoint_with_an_unknown_sampler_entry_loads_with_a_warning(tmp_path):
    """A sampler entry of another version (Lightning's ddp ignores unknown keys) warns and fits on; no refusal."""
    first = trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    first.fit(Regressor(), loader(8))
    path = Path(first.checkpoint_callback.best_model_path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint[CHECKPOINT_KEY] = {"version": 99, "loaders": "elsewhere"}
    torch.save(checkpoint, tmp_path / "other.ckpt")
    resumed = trainer(tmp_path, max_epochs=2)
    with pytest.warns(UserWarning, match="not a version-1 sampler position.* It is ignored"):
        resumed.fit(Regressor(), loader(8), ckpt_path=tmp_path / "other.ckpt")
    assert resumed.global_step == 8


# ------------------------------------------------------------------------------------------ data errors
def batches(dataloader: DataLoader, num_replicas: int, **kwargs) -> list[list[int]]:
    """Batch sizes each of ``num_replicas`` ranks reads from the injected loader, rank by rank."""
    return [[len(b[0]) for b in inject_distributed_sampler(dataloader, num_replicas, r, 0, **kwargs)]
            for r in range(num_replicas)]


def test_drop_last_without_a_batch_error_suggestions_work():
    """5 samples, 2 ranks, batch_size=4, drop_last=True: no rank gets a batch. Lowering batch_size to 3,
    drop_last=False or one device each gives every rank a batch."""
    with pytest.raises(ValueError, match="Lower batch_size to at most 3, set drop_last=False, or use fewer devices"):
        batches(loader(5, 4, drop_last=True), 2)
    assert batches(loader(5, 3, drop_last=True), 2) == [[3], [3]]
    assert batches(loader(5, 4, drop_last=False), 2) == [[3], [3]]
    assert batches(loader(5, 4, drop_last=True), 1) == [[4]]


def test_fewer_samples_than_ranks_error_suggestions_work():
    """An unpadded (evaluation) loader of 1 sample on 2 ranks is refused; 2 samples, or 1 device, reads each once."""
    with pytest.raises(ValueError, match="Use a data set with at least 2 samples, or fewer devices"):
        batches(loader(1, 1), 2, pad=False)
    assert batches(loader(2, 1), 2, pad=False) == [[1], [1]]
    assert batches(loader(1, 1), 1, pad=False) == [[1]]


def test_short_batch_warning_suggestion_removes_it():
    """batch_size=4 with 6 training samples on 2 ranks warns; the suggested batch_size=3 gives full batches."""
    with pytest.warns(UserWarning, match="Lower batch_size to at most 3"):
        assert batches(loader(6, 4), 2) == [[3], [3]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batches(loader(6, 3), 2) == [[3], [3]]


def test_padded_evaluation_warning_suggestions_give_exact_shards():
    """An evaluation loader that cannot be sharded exactly warns; each suggested change (batch_size >= 2 and
    drop_last=False with at least W samples, or a multiple of W samples) reads every sample exactly once."""
    for padded in (loader(5, 1), loader(5, 2, drop_last=True), loader(1, 4)):
        with pytest.warns(UserWarning, match="For exact metrics use batch_size >= 2 and drop_last=False with at"):
            shard_for_evaluation(padded, 2, 0, 0, None, "validation")
    for exact in (loader(5, 2), loader(6, 1), loader(2, 4)):
        assert needs_padding(exact, 2) is None
        shards = [[len(b[0]) for b in shard_for_evaluation(exact, 2, r, 0, None, "validation")] for r in (0, 1)]
        assert sum(map(sum, shards)) == len(exact.dataset)
        assert len(shards[0]) == len(shards[1])


def test_global_batch_warnings_suggested_batch_size_is_silent():
    """Each batch-size warning's suggested per-device batch_size raises no warning for the same run."""
    (message,) = batch_size_warnings(1024, 2, 1438)
    assert "pass batch_size=512" in message
    assert batch_size_warnings(512, 2, 1438) == []


def test_all_gather_shape_error_suggestion_works():
    """Shapes that differ beyond the first dimension are refused; padded to a common trailing shape they pass."""
    with pytest.raises(ValueError, match="Pad or reshape them to a common shape"):
        check_gatherable([(3, 4), (2, 5)], 0)
    check_gatherable([(3, 5), (2, 5)], 0)


# ------------------------------------------------------------------------------------ settings errors
def test_cpu_oversubscription_warning_suggestions_silence_it(monkeypatch):
    """More CPU processes than cores warns; devices=<cores> or allow_cpu_oversubscription=True does not."""
    monkeypatch.setattr(launching.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.warns(UserWarning, match=r"Pass devices=2 or fewer .*MyDDPStrategy\(allow_cpu_oversubscription=True\)"):
        launching.check_cpu_processes(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launching.check_cpu_processes(2)
        launching.check_cpu_processes(3, allow_oversubscription=MyDDPStrategy(
            allow_cpu_oversubscription=True)._options.allow_cpu_oversubscription)


def test_fork_with_cuda_error_suggestions_pass_the_check(monkeypatch):
    """fork with CUDA initialised is refused; the suggested start_method='spawn' or 'popen' passes the check."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="use start_method='spawn' or 'popen'"):
        launching.check_fork_safe("fork", "cuda")
    for method in ("spawn", "popen"):
        launching.check_fork_safe(method, "cuda")
        MyDDPStrategy(start_method=method)


def test_backend_error_suggestions_resolve_to_gloo_on_cpu():
    """nccl on CPU and an unknown name are refused; the suggested 'gloo' and None give gloo, which fits."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="Use process_group_backend='gloo' \\(or None\\)"):
        process_group.resolve_backend(cpu, "nccl")
    with pytest.raises(ValueError, match="or leave it as None"):
        MyDDPStrategy(process_group_backend="glooo")
    assert process_group.resolve_backend(cpu, "gloo") == process_group.resolve_backend(cpu, None) == "gloo"


def test_init_method_error_suggestions_are_accepted(tmp_path):
    """A URL without a port or of another scheme is refused; each suggested form is accepted, and tcp:// fits."""
    with pytest.raises(ValueError, match="write it as 'tcp://host:port'"):
        MyDDPStrategy(init_method="tcp://127.0.0.1")
    with pytest.raises(ValueError, match="use 'env://' .* or pass a torch.distributed Store as store="):
        MyDDPStrategy(init_method="http://127.0.0.1:80")
    for url in ("env://", "tcp://127.0.0.1:29500", f"file://{tmp_path}/x"):
        MyDDPStrategy(init_method=url)
    tcp = MyDDPStrategy(timeout=30, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert fit_steps(tmp_path, Regressor(), tcp) == 3


def test_comm_hook_and_ddp_option_error_suggestions_are_accepted(tmp_path):
    """An unknown hook name or DDP option is refused; every listed hook name and DDP option is accepted (they
    are this PyTorch's), a wrapper with its hook is accepted, and a listed hook fits."""
    with pytest.raises(ValueError, match=r"use one of \['allreduce', 'bf16', 'fp16', 'powersgd'\]"):
        MyDDPStrategy(ddp_comm_hook="fp32")
    for name in HOOKS_BY_NAME:
        MyDDPStrategy(ddp_comm_hook=name)
    wrapper = importlib.import_module("torch.distributed.algorithms.ddp_comm_hooks.default_hooks").fp16_compress_wrapper
    with pytest.raises(TypeError, match="pass the hook too"):
        CommHookConfig(wrapper=wrapper)
    CommHookConfig(hook="allreduce", wrapper=wrapper)
    with pytest.raises(TypeError, match="valid options are") as error:
        MyDDPStrategy(bucket_size_mb=25)
    listed = eval(str(error.value).split("valid options are ")[1].rstrip("."))  # the list the message prints
    assert set(listed) <= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    assert "bucket_cap_mb" in listed
    assert fit_steps(tmp_path, Regressor(), MyDDPStrategy(timeout=30, ddp_comm_hook="fp16", bucket_cap_mb=1)) == 3


def test_reduce_group_error_suggestion_works():
    """strategy.reduce with a group is refused; the suggested group=None reduces (here one process: the mean)."""
    strategy = MyDDPStrategy()
    with pytest.raises(ValueError, match="pass group=None"):
        strategy.reduce(torch.tensor([1.0, 3.0]), group=object())
    assert strategy.reduce(torch.tensor([1.0, 3.0]), group=None).tolist() == [1.0, 3.0]


# --------------------------------------------------------------------------------- checkpoint helpers
class Holder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)


def test_import_plain_checkpoint_error_suggestions_work(tmp_path):
    """A plain module with output_path, or a file without optimizer state, is refused; output_path=None loads
    the weights, and a LightningModule with optimizer state writes a checkpoint that fits."""
    plain = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "full.pt")
    torch.save({"model": plain.state_dict()}, tmp_path / "weights.pt")
    target = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="Pass the LightningModule, or output_path=None"):
        import_plain_checkpoint(tmp_path / "full.pt", target, tmp_path / "out.ckpt")
    import_plain_checkpoint(tmp_path / "full.pt", target, output_path=None)
    assert torch.equal(target.weight, plain.weight)
    holder = Holder()
    with pytest.raises(ValueError, match="load the weights with output_path=None instead"):
        import_plain_checkpoint(tmp_path / "weights.pt", holder, tmp_path / "out.ckpt")
    import_plain_checkpoint(tmp_path / "weights.pt", holder, output_path=None)
    assert torch.equal(holder.model.weight, plain.weight)
    import_plain_checkpoint(tmp_path / "full.pt", Holder(), tmp_path / "out.ckpt")
    assert torch.equal(torch.load(tmp_path / "out.ckpt")["state_dict"]["model.weight"], plain.weight)


def test_plain_state_dict_submodule_error_suggestions_work(tmp_path):
    """submodule='model' on a checkpoint of another attribute is refused; submodule='' or the attribute works."""
    checkpoint = {"state_dict": {"net.weight": torch.ones(1, 2), "net.bias": torch.zeros(1)}}
    with pytest.raises(KeyError, match="Pass submodule='' for the whole state dict, or the attribute name"):
        plain_state_dict(checkpoint, tmp_path / "c.ckpt")
    assert set(plain_state_dict(checkpoint, tmp_path / "c.ckpt", submodule="")) == {"net.weight", "net.bias"}
    assert set(plain_state_dict(checkpoint, tmp_path / "c.ckpt", submodule="net")) == {"weight", "bias"}


def test_safetensors_missing_error_suggestions_work(tmp_path, monkeypatch):
    """Without safetensors, a .safetensors export is refused; a .pt path writes a PyTorch file that torch.load
    reads, and the suggested extra 'ddp_strategy[safetensors]' exists and brings safetensors."""
    holder = Holder()
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # what `import` finds when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'ddp_strategy\[safetensors\]', or export a PyTorch file"):
        export_weights(holder, tmp_path / "w.safetensors")
    export_weights(holder, tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt")["weight"], holder.model.weight)
    requires = importlib.metadata.requires("ddp_strategy") or []
    assert any(r.startswith("safetensors") and 'extra == "safetensors"' in r for r in requires), requires


# ---------------------------------------------------------------------------------- two processes
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One 2-process launch (tests/error_suggestion_workers.py); every rank's record."""
    from error_suggestion_workers import scenario_suggestions
    from sampling_workers import launch, load

    out = tmp_path_factory.mktemp("suggestions")
    launch(scenario_suggestions, 2, out)
    return load(out, "suggestions", 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_uneven_user_shards_error_each_suggested_fix_trains(two_ranks):
    """Shards of 3 and 2 batches are refused on both ranks; letting the strategy shard the whole data set, or
    equal user shards, trains every rank the same number of steps over every sample."""
    for record in two_ranks:
        assert "Let MyDDPStrategy shard the data" in record["uneven_error"]
        assert "Trainer(use_distributed_sampler=True)" in record["uneven_error"]
    sharded = [[i for batch in r["sharded"] for i in batch] for r in two_ranks]
    assert [len(r["sharded"]) for r in two_ranks] == [3, 3]
    assert sorted(sharded[0] + sharded[1]) == list(range(20))
    equal = [[i for batch in r["equal"] for i in batch] for r in two_ranks]
    assert equal == [list(range(0, 24, 2)), list(range(1, 24, 2))]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_padded_all_gather_warning_suggestion_gathers_each_row_once(two_ranks):
    """3 samples on 2 ranks: self.all_gather pads (sample 0 twice, as DistributedSampler pads) and rank 0 warns; the
    suggested ddp_strategy.all_gather_rows gives each sample exactly once, with no warning."""
    rank0, rank1 = two_ranks
    assert sorted(rank0["gathered_exact=False"]) == [0, 0, 1, 2]
    assert len(rank0["warnings_exact=False"]) == 1 and "all_gather_rows(tensor)" in rank0["warnings_exact=False"][0]
    assert rank1["warnings_exact=False"] == []
    for record in two_ranks:
        assert sorted(record["gathered_exact=True"]) == [0, 1, 2]
        assert record["warnings_exact=True"] == []
