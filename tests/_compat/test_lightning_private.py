"""Guards every private Lightning name we use, in every installed namespace (``lightning.pytorch`` and
``pytorch_lightning``): a Lightning upgrade that moves or changes one fails here, loudly."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace

pytestmark = pytest.mark.compat

#: The Lightning minors this package is tested with (setup.cfg and the README's Compatibility table).
SUPPORTED_MINORS = ("2.4.", "2.5.", "2.6.")


class Namespace:
    """One installed Lightning namespace, imported: its name, version and objects by path (``_namespace.get``)."""

    def __init__(self, name: str) -> None:
        self.name, self.version = name, _namespace.get("pytorch:__version__", name)
        self.pytorch = _namespace.get("pytorch", name)

    def get(self, path: str):
        return _namespace.get(path, self.name)


@pytest.fixture(params=_namespace.installed())
def namespace(request) -> Namespace:
    """Each installed namespace, imported (another process may choose either)."""
    return Namespace(request.param)


@pytest.fixture
def ours() -> Namespace:
    """This process's namespace: the one our classes derive from."""
    return Namespace(_namespace.NAME)


def signature_of(obj) -> list[str]:
    """Parameter names of ``obj``."""
    return list(inspect.signature(obj).parameters)


def _private(namespace: Namespace, name: str):
    return namespace.get(_pl.PRIVATE_NAMES[name])


def test_every_private_name_resolves(namespace):
    """Every private name listed in _lightning_private exists in this namespace."""
    for name in _pl.PRIVATE_NAMES:
        assert _private(namespace, name) is not None


def test_tested_lightning_minor(namespace):
    """We test Lightning 2.4, 2.5 and 2.6; setup.cfg pins >=2.4,<2.7 because of the names below."""
    assert namespace.version.startswith(SUPPORTED_MINORS)


def test_launchers_keep_their_signatures(namespace):
    """The launchers we construct take the arguments we pass."""
    assert signature_of(_private(namespace, "SubprocessScriptLauncher")) == [
        "cluster_environment",
        "num_processes",
        "num_nodes",
    ]
    assert signature_of(_private(namespace, "MultiProcessingLauncher")) == ["strategy", "start_method"]
    # process/launching.py's launchers override _wrapping_function and read the popen launcher's procs
    assert signature_of(_private(namespace, "MultiProcessingLauncher")._wrapping_function)[:4] == [
        "self",
        "process_idx",
        "trainer",
        "function",
    ]
    env = namespace.get("fabric.plugins.environments:LightningEnvironment")()
    assert _private(namespace, "SubprocessScriptLauncher")(env, 2, 1).procs == []


def test_our_popen_launcher_is_lightnings(ours):
    """Our SubprocessScriptLauncher is a subclass of the process namespace's."""
    env = ours.get("fabric.plugins.environments:LightningEnvironment")()
    launcher = _pl.SubprocessScriptLauncher(env, 2, 1)
    assert isinstance(launcher, _private(ours, "SubprocessScriptLauncher"))
    assert isinstance(launcher, _pl.SubprocessScriptLauncher)
    assert launcher.num_processes == 2


def test_forward_redirection_hooks_exist(namespace):
    """Lightning DDP's forward redirection (our base) turns DDP's gradient sync off inside a manual-optimization
    training_step and back on after it; we override __call__."""
    redirection = _private(namespace, "DDPForwardRedirection")
    assert "require_backward_grad_sync = False" in inspect.getsource(redirection.on_after_inner_forward)
    assert "require_backward_grad_sync = True" in inspect.getsource(redirection.on_after_outer_forward)
    assert callable(redirection.__call__)
    assert signature_of(_private(namespace, "prepare_for_backward")) == ["model", "output"]


def test_checkpoint_loading_takes_weights_only_or_we_load_ourselves(namespace):
    """Strategy.load_checkpoint and TorchCheckpointIO.load_checkpoint take weights_only together (2.6) or not at
    all (2.4, 2.5); Fabric's cloud_io._load, which DDPCheckpointIO calls for remote files, takes it everywhere."""
    strategy_takes = "weights_only" in signature_of(namespace.get("pytorch.strategies:Strategy.load_checkpoint"))
    io_method = namespace.get("fabric.plugins.io.torch_io:TorchCheckpointIO.load_checkpoint")
    assert ("weights_only" in signature_of(io_method)) == strategy_takes == namespace.version.startswith("2.6.")
    assert signature_of(_private(namespace, "cloud_load"))[:3] == ["path_or_url", "map_location", "weights_only"]


def test_remote_loading_honours_weights_only(ours):
    """From a non-local fsspec file system (memory://), DDPCheckpointIO refuses a pickled object by default."""
    import argparse
    import pickle

    import fsspec

    from ddp_strategy import DDPCheckpointIO

    namespace = ours
    fs = fsspec.filesystem("memory")
    with fs.open(f"/{namespace.name}/object.ckpt", "wb") as f:
        torch.save({"state_dict": {}, "object": argparse.Namespace(a=1)}, f)
    io = DDPCheckpointIO()
    with pytest.raises(pickle.UnpicklingError):
        io.load_checkpoint(f"memory://{namespace.name}/object.ckpt")
    assert io.load_checkpoint(f"memory://{namespace.name}/object.ckpt", weights_only=False)["object"].a == 1
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(f"memory://{namespace.name}/missing.ckpt")
    fs.rm(f"/{namespace.name}", recursive=True)


def test_update_dataloader_replaces_the_sampler(namespace):
    """Lightning's loader re-instantiation still keeps batch_size and takes our sampler."""
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=3)
    sampler = list(reversed(range(6)))
    new = _private(namespace, "update_dataloader")(loader, sampler)
    assert new.batch_size == 3 and [b[0].tolist() for b in new] == [[5, 4, 3], [2, 1, 0]]


def test_sampler_injection_flag_lives_on_the_accelerator_connector(namespace):
    """Turning Lightning's own sampler injection off and back on restores the user's value."""
    trainer = namespace.pytorch.Trainer(accelerator="cpu", devices=1, use_distributed_sampler=True, logger=False)
    assert _pl.set_lightning_sampler_injection(trainer, enabled=False) is True
    assert trainer._accelerator_connector.use_distributed_sampler is False
    _pl.set_lightning_sampler_injection(trainer, enabled=True)
    assert trainer._accelerator_connector.use_distributed_sampler is True


def test_is_interactive_needs_a_running_ipython_not_just_an_import(monkeypatch, namespace):
    """pytest is not interactive; importing ipykernel is not either; a running IPython shell is."""
    import sys
    import types

    assert isinstance(_private(namespace, "is_interactive"), bool)
    assert _pl.is_interactive() is False
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: None
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert _pl.is_interactive() is False
    fake.get_ipython = lambda: object()
    assert _pl.is_interactive() is True


def test_sampler_injection_keeps_the_users_false(namespace):
    """Enabling Lightning's injection (predict) restores the user's use_distributed_sampler=False, never forces True."""
    trainer = namespace.pytorch.Trainer(accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False)
    assert _pl.set_lightning_sampler_injection(trainer, enabled=True) is False
    assert trainer._accelerator_connector.use_distributed_sampler is False


def test_update_dataloader_batch_sampler_keeps_subclass_arguments(namespace):
    """A DataLoader subclass with its own __init__ argument is re-created around a given batch sampler: the
    subclass, its argument, num_workers and collate_fn stay; Lightning's private resolution helpers exist in
    every namespace."""

    class Tagged(DataLoader):
        def __init__(self, dataset, tag, **kwargs):
            super().__init__(dataset, **kwargs)
            self.tag = tag

    class Odd(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([[1], [3, 5]])

        def __len__(self):
            return 2

    def collate(items):
        return torch.stack([t[0] for t in items]) * 10

    loader = Tagged(TensorDataset(torch.arange(6)), tag="x", batch_sampler=Odd(), collate_fn=collate)
    new = _pl.update_dataloader_batch_sampler(loader, [[0, 2], [4]])
    assert type(new) is Tagged and new.tag == "x" and new.collate_fn is collate
    assert [b.tolist() for b in new] == [[0, 20], [40]]
    assert loader.batch_sampler.__class__ is Odd  # the user's loader is untouched
    for key in ("get_dataloader_init_args_and_kwargs", "reinstantiate_wrapped_cls"):
        assert callable(namespace.get(_pl.PRIVATE_NAMES[key]))


def test_compiled_models_are_accepted_for_our_strategy_only(ours):
    """The trainer module calls _verify_strategy_supports_compile(model, strategy) in fit/validate/test/predict;
    our replacement accepts MyDDPStrategy and still refuses a compiled model on other strategies."""
    from ddp_strategy import DigitsClassifier, MyDDPStrategy

    namespace = ours
    trainer_module = namespace.get("pytorch.trainer.trainer")
    compile_module = namespace.get("pytorch.utilities.compile")
    assert inspect.signature(compile_module._verify_strategy_supports_compile).parameters.keys() == {
        "model",
        "strategy",
    }
    trainer_cls = namespace.pytorch.Trainer
    for method in (trainer_cls.fit, trainer_cls.validate, trainer_cls.test, trainer_cls.predict):
        assert "_verify_strategy_supports_compile" in method.__code__.co_names
    check = trainer_module._verify_strategy_supports_compile
    assert check is not compile_module._verify_strategy_supports_compile  # ours, in the trainer module
    model = DigitsClassifier()
    model._compiler_ctx = {"compiler": "dynamo"}
    check(model, MyDDPStrategy())
    check(model, namespace.get("pytorch.strategies:SingleDeviceStrategy")("cpu"))
    assert not issubclass(MyDDPStrategy, namespace.get("pytorch.strategies:DDPStrategy"))
    with pytest.raises(RuntimeError, match="Using a compiled model is incompatible with the current strategy"):
        check(model, object())  # any strategy outside Lightning's list is still refused


def test_epoch_batch_progress_counters_shift_together(namespace):
    """The epoch loop's batch progress has current/total trackers with the four counters we shift."""
    trainer = namespace.pytorch.Trainer(accelerator="cpu", devices=1, logger=False)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.current.ready = progress.total.ready = 5
    _pl.shift_epoch_batch_progress(trainer, -2)
    assert progress.current.ready == progress.total.ready == 3
    assert progress.current.completed == progress.total.completed == -2
    assert {"ready", "started", "processed", "completed"} <= set(vars(progress.current))


def test_not_resumable_warning_text_is_still_lightnings(namespace):
    """The strategy silences Lightning's 'dataloader is not resumable' warning by its text; the text must match."""
    from ddp_strategy.sampling.state import LIGHTNING_NOT_RESUMABLE_WARNING

    assert LIGHTNING_NOT_RESUMABLE_WARNING in inspect.getsource(namespace.get("pytorch.loops.training_epoch_loop"))


def test_base_class_attributes_the_strategy_sets_or_reads(ours):
    """MyDDPStrategy uses four underscore attributes of Lightning's Strategy/ParallelStrategy, as Lightning's own
    DDPStrategy does: _launcher, _checkpoint_io, _layer_sync (filled by Trainer(sync_batchnorm=True)) and
    _forward_redirection (routes training_step through DDP's forward)."""
    from ddp_strategy import MyDDPStrategy

    namespace = ours
    ParallelStrategy = namespace.get("pytorch.strategies:ParallelStrategy")
    _ForwardRedirection = _private(namespace, "DDPForwardRedirection")
    s = MyDDPStrategy()
    for name in ("_launcher", "_checkpoint_io", "_layer_sync", "_forward_redirection"):
        assert name in vars(s), f"Lightning's Strategy no longer sets {name}"
    assert isinstance(s._forward_redirection, _ForwardRedirection)
    assert callable(getattr(ParallelStrategy, "_configure_launcher", None))
    strategy = MyDDPStrategy(start_method="spawn")
    trainer = namespace.pytorch.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, sync_batchnorm=True, logger=False
    )
    assert isinstance(trainer.strategy, ParallelStrategy)
    assert type(trainer.strategy._layer_sync).__name__ == "TorchSyncBatchNorm"
    assert trainer.strategy._launcher is trainer.strategy.launcher


def test_resumed_batch_count_follows_the_versions_restart_rule(namespace):
    """Saved at a batch end (completed one behind): 2.5+ resume after that batch, 2.4 one earlier; saved
    elsewhere (all counters equal): every version resumes at completed."""
    trainer = namespace.pytorch.Trainer(accelerator="cpu", devices=1, logger=False)
    epoch_loop = trainer.fit_loop.epoch_loop
    assert hasattr(epoch_loop, "restarted_on_train_batch_end") == (not namespace.version.startswith("2.4."))
    for tracker in (epoch_loop.batch_progress.current, epoch_loop.batch_progress.total):
        tracker.ready = tracker.started = tracker.processed = 5
        tracker.completed = 4
    assert _pl.resumed_batch_count(trainer) == (4 if namespace.version.startswith("2.4.") else 5)
    epoch_loop.batch_progress.total.completed = epoch_loop.batch_progress.current.completed = 5
    assert _pl.resumed_batch_count(trainer) == 5


def test_multiprocessing_launcher_worker_signature(namespace):
    """launching.CheckedMultiProcessingLauncher overrides Lightning's private _wrapping_function (to run the
    strategy's on_exception inside each rank): its leading parameters must stay (process_idx, trainer, function)."""
    params = signature_of(_private(namespace, "MultiProcessingLauncher")._wrapping_function)
    assert params[:4] == ["self", "process_idx", "trainer", "function"]
    assert params[4:] == ["args", "kwargs", "return_queue", "global_states"]


def _body(function) -> list[str]:
    """``function``'s statements, unparsed, without its docstring."""
    import ast
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return [ast.unparse(statement) for statement in body[int(docstring) :]]


def test_the_popen_launcher_is_lightnings_with_our_supervisor_in_place_of_its_observer(namespace):
    """_compat's SubprocessScriptLauncher.launch is Lightning's statement for statement, but for the observer it
    starts; _call_children_scripts fills procs, and the observer takes (main_pid, child_processes) and, on a poll
    that finds a child exited non-zero, calls _terminate_all, which SIGKILLs the children and main_pid."""
    import subprocess

    lightning_launch = _private(namespace, "SubprocessScriptLauncher").launch
    ours = _body(_pl.SubprocessScriptLauncher.launch)
    supervise = [
        "supervisor = Supervisor(os.getpid(), self.procs)",
        "supervisor.start()",
        "atexit.register(supervisor.stop)",
    ]
    assert all(line in ours[1] for line in supervise)
    ours[1] = ours[1].replace("\n    ".join(supervise), "_launch_process_observer(self.procs)")
    assert ours == _body(lightning_launch)
    assert "self.procs.append(" in inspect.getsource(
        _private(namespace, "SubprocessScriptLauncher")._call_children_scripts
    )
    observer_cls = namespace.get(_pl.PRIVATE_NAMES["ChildProcessObserver"])
    assert signature_of(observer_cls)[:3] == ["main_pid", "child_processes", "sleep_period"]
    assert observer_cls(0, [])._sleep_period == 5  # Supervisor.run polls every _sleep_period seconds
    assert lightning_launch.__globals__["_launch_process_observer"].__globals__["_ChildProcessObserver"] is observer_cls
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for this process
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait()
    observer = observer_cls(main_pid=main.pid, child_processes=[failed])  # not started: _run is one poll
    assert observer._run() is True and main.wait(10) == -signal.SIGKILL


def test_the_supervisor_gives_the_launching_process_its_grace_and_stops_the_ranks_at_its_exit(monkeypatch):
    """After a rank exited non-zero the supervisor SIGKILLs the launching process only once GRACE_S have passed; at
    the exit it SIGKILLs and reaps a rank still running GRACE_S later, with a warning naming it, and one that exits
    in time is reaped without a word; then its thread has ended (not left in its 5 s poll)."""
    import subprocess
    import warnings

    assert _pl.GRACE_S == 30.0
    monkeypatch.setattr(_pl, "GRACE_S", 0.5)
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait()
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for this process
    start = time.monotonic()
    supervisor = _pl.Supervisor(main.pid, [failed])
    assert supervisor._run() is True  # one poll (not started)
    assert time.monotonic() - start >= 0.5 and main.wait(10) == -signal.SIGKILL
    stalled = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        supervisor = _pl.Supervisor(os.getpid(), [quick, stalled])
        supervisor.start()
        supervisor.stop()
    assert not supervisor.is_alive()  # stop() ends the thread, mid-poll (issue 51 item 6)
    assert (quick.returncode, stalled.returncode) == (0, -signal.SIGKILL)
    assert [str(w.message) for w in caught] == [
        f"local rank 2 (pid {stalled.pid}) is still running 0 s after the launching process: SIGKILL"
    ]


def test_the_popen_launcher_starts_the_supervisor_alone_and_only_for_the_ranks_it_starts(monkeypatch):
    """launch() runs the function after starting one Supervisor (no Lightning observer) on the ranks
    _call_children_scripts started, and under an external launcher (LOCAL_RANK set) starts neither."""
    import atexit
    import subprocess
    import threading

    env = _namespace.get("fabric.plugins.environments:LightningEnvironment")()
    launcher = _pl.SubprocessScriptLauncher(env, 2, 1)
    started = []
    monkeypatch.setattr(
        launcher,
        "_call_children_scripts",
        lambda: launcher.procs.append(subprocess.Popen([sys.executable, "-c", "pass"])),
    )
    monkeypatch.setattr(atexit, "register", started.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    before = set(threading.enumerate())
    assert launcher.launch(lambda x: x + 1, 41) == 42
    observers = [t for t in set(threading.enumerate()) - before if t.name == "child-process-observer"]
    assert [type(t) for t in observers] == [_pl.Supervisor] and started == [observers[0].stop]
    assert observers[0]._child_processes is launcher.procs and len(launcher.procs) == 1
    observers[0].stop()  # reaps the rank
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launcher.launch(lambda: 7) == 7 and len(launcher.procs) == 1 and len(started) == 1


def test_lightnings_collectives_keep_their_signatures_and_world_of_one_behaviour(namespace):
    """_all_gather_ddp_if_available and _gather_all_tensors take the arguments the strategy passes; without a
    process group the first returns the tensor itself (the strategy relies on that)."""
    assert signature_of(_private(namespace, "all_gather_ddp_if_available")) == ["tensor", "group", "sync_grads"]
    assert signature_of(_private(namespace, "gather_all_tensors")) == ["result", "group"]
    t = torch.ones(2)
    assert _private(namespace, "all_gather_ddp_if_available")(t, sync_grads=True) is t


def test_optimizers_to_device_moves_the_optimizer_state(namespace):
    """_optimizers_to_device(optimizers, device) moves every state tensor but ``step`` (what DDPStrategy.setup
    calls after the optimizers are set up, and MyDDPStrategy.setup too)."""
    assert signature_of(_private(namespace, "optimizers_to_device")) == ["optimizers", "device"]
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.9)
    optimizer.state[parameter]["momentum_buffer"] = buffer = torch.ones(2, dtype=torch.float64)
    _private(namespace, "optimizers_to_device")([optimizer], torch.device("meta"))
    assert optimizer.state[parameter]["momentum_buffer"].device.type == "meta" and buffer.device.type == "cpu"


def test_trainer_save_checkpoint_saves_then_calls_the_named_barrier(namespace, tmp_path):
    """Trainer.save_checkpoint (weights only or not) calls strategy.save_checkpoint, then barrier(SAVE_BARRIER): the
    name by which a save is announced in a step some ranks only shadow (uneven inputs)."""
    trainer = namespace.pytorch.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False
    )
    model = namespace.get("pytorch.demos.boring_classes:BoringModel")()
    trainer.strategy.connect(model)
    model.trainer = trainer
    calls = []
    save, barrier = trainer.strategy.save_checkpoint, trainer.strategy.barrier

    class Recorder:
        def save_checkpoint(self, *args, **kwargs):
            calls.append("save")
            return save(*args, **kwargs)

    trainer.strategy.save_checkpoint = Recorder().save_checkpoint
    trainer.strategy.barrier = lambda name=None: calls.append(name) or barrier(name)
    for weights_only in (False, True):
        calls.clear()
        trainer.save_checkpoint(tmp_path / f"{weights_only}.ckpt", weights_only=weights_only)
        assert calls == ["save", _pl.SAVE_BARRIER]
        assert (tmp_path / f"{weights_only}.ckpt").is_file()


def test_sigterm_notifier_is_taken_over_and_the_per_batch_broadcast_turned_off(namespace):
    """Lightning's SIGTERM handler calls our note instead of its notifier (no flag set, no broadcast), 2.5+'s loop
    broadcast is a no-op, and setting received_sigterm is what trainer.received_sigterm reads."""
    trainer = namespace.pytorch.Trainer(accelerator="cpu", devices=1, logger=False)
    connector, noted = trainer._signal_connector, []
    previous = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()
    try:
        assert _pl.take_over_sigterm(trainer, lambda signum, frame: noted.append(signum))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert noted == [signal.SIGTERM] and not trainer.received_sigterm
        if not namespace.version.startswith("2.4."):  # 2.4 has no per-batch broadcast
            assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
        _pl.set_received_sigterm(trainer, True)
        assert trainer.received_sigterm
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, previous)
    assert not _pl.take_over_sigterm(trainer, print)  # not Lightning's handler: nothing changed


def test_the_per_batch_sigterm_broadcast_is_where_we_turn_it_off_and_lightning_stops_where_we_set_the_flag(namespace):
    """2.5+: the loop's only collective is _broadcast_sigterm_tensor, called from advance (2.4: none); every version
    raises SIGTERMException at a training step's and an epoch's end where received_sigterm is set."""
    loop_cls = namespace.get("pytorch.loops.training_epoch_loop:_TrainingEpochLoop")
    source = inspect.getsource(namespace.get("pytorch.loops.training_epoch_loop"))
    has_broadcast = not namespace.version.startswith("2.4.")
    assert hasattr(loop_cls, "_broadcast_sigterm_tensor") == has_broadcast
    assert source.count("torch.distributed.broadcast(") == int(has_broadcast)
    if has_broadcast:
        assert "torch.distributed.broadcast(" in inspect.getsource(loop_cls._broadcast_sigterm_tensor)
        assert "self._broadcast_sigterm_tensor()" in inspect.getsource(loop_cls.advance)
    step_end = inspect.getsource(namespace.get("pytorch.loops.training_epoch_loop:_TrainingEpochLoop.on_advance_end"))
    assert "self.trainer.received_sigterm:\n            raise SIGTERMException" in step_end
    epoch_end = inspect.getsource(namespace.get("pytorch.loops.fit_loop:_FitLoop.on_advance_end"))
    assert "if trainer.received_sigterm:\n            raise SIGTERMException" in epoch_end
    assert "received_sigterm = True" in inspect.getsource(namespace.get(_pl.PRIVATE_NAMES["sigterm_notifier"]))


def test_training_state_round_trips_and_cut_epoch_sets_the_loops_counts(namespace, tmp_path):
    """After a 1-process fit, training_state holds the optimizer's momentum, the scheduler's and the step counters,
    and the ModelCheckpoint's last saved step; load_training_state into another fitted Trainer makes it read the
    same (global_step too), and an EMAWeightAveraging's averaged weights and last update step where the namespace
    has it (Lightning >= 2.5); cut_epoch sets fit_loop.max_batches and a fractional val_check_interval's batch."""
    from ddp_strategy.testing import assert_same_on_every_rank

    boring_model = namespace.get("pytorch.demos.boring_classes:BoringModel")
    model_checkpoint = namespace.get("pytorch.callbacks:ModelCheckpoint")
    ema = getattr(namespace.pytorch.callbacks, "EMAWeightAveraging", None)

    class Momentum(boring_model):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def fitted(steps: int):
        trainer = namespace.pytorch.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            val_check_interval=0.5,
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[
                model_checkpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1),
                *([ema(decay=0.5)] if ema else []),
            ],
        )
        trainer.fit(Momentum())
        return trainer

    source, target = fitted(3), fitted(1)
    state = _pl.training_state(source)
    assert state["states"][0]["state"] and state["private"][1] == 3 and target.global_step == 1  # the optimizer's
    assert state["private"][2:3] == ([3] if ema else [])  # the EMA callback's last update step
    _pl.load_training_state(target, state)
    assert target.global_step == 3 and target.checkpoint_callback._last_global_step_saved == 3
    assert_same_on_every_rank([state, _pl.training_state(target)], "training state")
    _pl.cut_epoch(target, 6)
    assert target.fit_loop.max_batches == 6 and target.val_check_batch == 3


def test_out_of_batches_reads_the_running_loops_fetcher_also_past_a_wrong_length_hint(namespace, tmp_path):
    """In a 1-process validate, out_of_batches is False before and during the steps and True at the epoch's end,
    for a sized loader (3 batches) and for an IterableDataset whose __len__ says 5 batches where it yields 3 (there
    Lightning's is_last_batch stays False); False without a running loop."""
    seen: list[tuple[str, bool, bool]] = []

    class Hinted(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.randn(6, 32))

        def __len__(self) -> int:
            return 10

    class Probe(namespace.get("pytorch.demos.boring_classes:BoringModel")):
        def on_validation_epoch_start(self):
            seen.append(
                ("start", _pl.out_of_batches(self.trainer), self.trainer.validate_loop.batch_progress.is_last_batch)
            )

        def on_validation_batch_start(self, batch, batch_idx):
            seen.append(("step", _pl.out_of_batches(self.trainer), False))

        def on_validation_epoch_end(self):
            seen.append(
                ("end", _pl.out_of_batches(self.trainer), self.trainer.validate_loop.batch_progress.is_last_batch)
            )

    # a sized loader's last step knows it is the last (done from the length); the wrong hint's does not
    for data, last_step in ((torch.randn(6, 32), True), (Hinted(), False)):
        seen.clear()
        trainer = namespace.pytorch.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
        )
        trainer.validate(Probe(), DataLoader(data, batch_size=2), verbose=False)
        expected = [("start", False), ("step", False), ("step", False), ("step", last_step), ("end", True)]
        assert [s[:2] for s in seen] == expected, seen
    assert seen[-1][2] is False  # the wrong hint: Lightning's is_last_batch never set
    assert not _pl.out_of_batches(trainer)


def test_rank_zero_only_is_lightning_utilities_own(namespace):
    """The strategy sets the rank once, on Lightning's rank_zero_only, which must be lightning_utilities' object (what
    Lightning's rank_zero_info/warn read in either namespace; Lightning's DDPStrategy sets both names)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    assert namespace.get("pytorch.utilities.rank_zero:rank_zero_only") is rank_zero_only


def test_a_failure_names_the_hook_lightning_was_calling_and_the_users_line_inside_it(namespace):
    """hook_of reads Lightning's trainer/call.py frames (their ``hook_name`` and ``fn`` locals): a failure in a
    callback hook and in a module hook called there is placed by failures.position (what a rank whose collective
    broke tells the others) at the hook's qualified name and the user's line inside it."""
    from ddp_strategy.process import failures

    class Failing(namespace.pytorch.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            raise ValueError("on purpose")

    class Module(namespace.get("pytorch.demos.boring_classes:BoringModel")):
        def on_train_start(self):
            torch.zeros(1).view(2)  # raises in torch's C++ (no frame): this line is the innermost

    for model, callbacks, expected in (
        (Module(), [], "on_train_start in Module.on_train_start, at test_lightning_private.py:"),
        (
            namespace.get("pytorch.demos.boring_classes:BoringModel")(),
            [Failing()],
            "on_train_epoch_end in Failing.on_train_epoch_end, at test_lightning_private.py:",
        ),
    ):
        trainer = namespace.pytorch.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            limit_train_batches=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            callbacks=callbacks,
        )
        with pytest.raises((ValueError, RuntimeError)) as raised:
            trainer.fit(model)
        assert failures.position(raised.value).startswith(expected), failures.position(raised.value)
