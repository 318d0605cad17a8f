"""Both Lightning namespaces, ``lightning.pytorch`` and ``pytorch_lightning``: each gets classes of its own, a
strategy follows the Trainer that connects it, and a user's imports choose the namespace."""

from __future__ import annotations

import itertools
import json
import pickle
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from ddp_testing import LIGHTNING_KEYS, finish, probe_input

from ddp_strategy import (
    DDPCheckpointIO,
    DigitsClassifier,
    DigitsDataModule,
    DigitsNet,
    MyDDPStrategy,
    load_plain_state_dict,
)
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.process.boundaries import EpochBoundaryCheck

pytestmark = pytest.mark.compat

INSTALLED = _namespace.installed()
SCRIPTS = Path(__file__).parent.parent / "scripts"
both = pytest.mark.skipif(len(INSTALLED) < 2, reason="needs both lightning and pytorch_lightning installed")


@pytest.fixture(params=INSTALLED)
def namespace(request) -> _namespace.Namespace:
    """Each installed namespace, imported."""
    return _namespace.load(request.param)


def _runtime_lightning_imports(path: Path) -> list[str]:
    """``import``s of either namespace in ``path`` that run (not under ``if TYPE_CHECKING:``)."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        for name in names:
            namespace_root = name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
            if namespace_root and id(node) not in typing_only:
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_no_module_but_namespace_imports_either_namespace():
    """Every runtime import of lightning/pytorch_lightning is in _namespace.py (which imports by name): the rest
    of the package imports from it, so it never imports a namespace the user does not have."""
    package = Path(_namespace.__file__).parent.parent
    found = [hit for path in sorted(package.rglob("*.py")) for hit in _runtime_lightning_imports(path)]
    assert found == []


def test_each_namespace_gets_classes_deriving_from_its_own_bases(namespace):
    """Built for one namespace, each of our Lightning-derived classes is that namespace's subclass, and ours."""
    get = namespace.get
    for public, base, args in (
        (MyDDPStrategy, get("pytorch.strategies:ParallelStrategy"), {}),
        (DigitsClassifier, get("pytorch:LightningModule"), {}),
        (DigitsDataModule, get("pytorch:LightningDataModule"), {}),
        (DDPCheckpointIO, get("fabric.plugins:CheckpointIO"), {}),
        (
            EpochBoundaryCheck,
            get("pytorch:Callback"),
            {"group": None, "timeout": timedelta(seconds=1), "rank": 0, "world_size": 1},
        ),
    ):
        obj = public.for_namespace(namespace.name)(**args)
        assert isinstance(obj, base) and isinstance(obj, public)
        assert _namespace.namespace_of(obj) == namespace.name
        assert type(obj).__qualname__ == public.__qualname__
        assert public.for_namespace(namespace.name) is type(obj)  # made once


class UsersStrategy(MyDDPStrategy):
    """A user's subclass of the public strategy."""


@both
@pytest.mark.parametrize("made_for, trainer_of", list(itertools.permutations(INSTALLED, 2)))
def test_a_strategy_built_for_one_namespace_becomes_the_others_in_its_trainer(made_for, trainer_of):
    """A strategy (or a user's subclass) built for one namespace, given to the other's Trainer, becomes that
    namespace's: the same object with its arguments, on that namespace's base, accelerator and launcher."""
    other = _namespace.load(trainer_of)
    for cls in (MyDDPStrategy, UsersStrategy):
        strategy = cls.for_namespace(made_for)(timeout=42, start_method="spawn")
        trainer = other.pytorch.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        assert trainer.strategy is strategy and isinstance(strategy, cls)
        assert _namespace.namespace_of(strategy) == trainer_of and type(strategy) is cls.for_namespace(trainer_of)
        bases = {k for k in type(strategy).__mro__ if k.__name__ == "ParallelStrategy"}
        assert bases == {other.get("pytorch.strategies:ParallelStrategy")}
        assert strategy._options.timeout == timedelta(seconds=42) and strategy.start_method == "spawn"
        assert isinstance(strategy.accelerator, other.get("pytorch.accelerators:CPUAccelerator"))
        launcher = other.get("pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher")
        assert isinstance(strategy.launcher, launcher)
        assert type(pickle.loads(pickle.dumps(strategy))) is type(strategy)  # spawn pickles it


def test_strategy_names_and_plugins_are_accepted_by_each_trainer(namespace):
    """Trainer(strategy="my_ddp") gives this namespace's MyDDPStrategy; Trainer(plugins=[DDPCheckpointIO()]) uses it."""
    io = DDPCheckpointIO()
    trainer = namespace.pytorch.Trainer(accelerator="cpu", devices=2, strategy="my_ddp", plugins=[io], logger=False)
    assert isinstance(trainer.strategy, MyDDPStrategy)
    assert _namespace.namespace_of(trainer.strategy) == namespace.name
    assert trainer.strategy.checkpoint_io is io


class SubClassifier(DigitsClassifier):
    """A user's subclass with one more hyper-parameter."""

    def __init__(self, extra: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


def test_save_hyperparameters_collects_our_init_arguments_in_each_namespace(namespace, tmp_path):
    """hparams hold every __init__ argument (ours and a user subclass's), and load_from_checkpoint rebuilds them."""
    model = DigitsClassifier.for_namespace(namespace.name)(hidden_size=8)
    assert dict(model.hparams) == {"hidden_size": 8, "learning_rate": 1e-3, "weight_decay": 0.0}
    sub = SubClassifier.for_namespace(namespace.name)(extra=5, hidden_size=4)
    assert dict(sub.hparams) == {"extra": 5, "hidden_size": 4, "learning_rate": 1e-3, "weight_decay": 0.0}
    data = DigitsDataModule.for_namespace(namespace.name)(batch_size=16)
    assert data.hparams["batch_size"] == 16
    path = tmp_path / "sub.ckpt"
    torch.save(
        {
            "state_dict": sub.state_dict(),
            sub.CHECKPOINT_HYPER_PARAMS_KEY: dict(sub.hparams),
            "pytorch-lightning_version": namespace.version,
        },
        path,
    )
    loaded = SubClassifier.for_namespace(namespace.name).load_from_checkpoint(path)
    assert dict(loaded.hparams) == dict(sub.hparams) and loaded.model.layers[0].out_features == 4
    by_public_name = SubClassifier.load_from_checkpoint(path)  # a class method of Lightning's, on our class
    assert isinstance(by_public_name, SubClassifier) and dict(by_public_name.hparams) == dict(sub.hparams)


def test_flavoured_objects_pickle_to_the_same_flavour(namespace):
    """spawn pickles the trainer: our objects come back as the same namespace's classes, with their state."""
    for obj in (
        MyDDPStrategy.for_namespace(namespace.name)(timeout=7),
        DigitsClassifier.for_namespace(namespace.name)(hidden_size=8),
    ):
        copy = pickle.loads(pickle.dumps(obj))
        assert type(copy) is type(obj)
    assert copy.hparams["hidden_size"] == 8
    assert torch.equal(copy.model.layers[0].weight, obj.model.layers[0].weight)


def _user_environ() -> dict[str, str]:
    """This process's environment without the suite's DDP_STRATEGY_LIGHTNING pin (tests/conftest.py): a user's
    process, whose imports choose the namespace."""
    import os

    return {k: v for k, v in os.environ.items() if k != _namespace.ENV_VAR}


def _fresh(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned."""

    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**_user_environ(), **(env or {})},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    code_, out = finish(proc, 120)
    assert code_ == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


_REPORT = """
import json, sys
from ddp_strategy import DigitsClassifier, MyDDPStrategy
from ddp_strategy._compat import namespace as _namespace
print(json.dumps({"strategy": _namespace.namespace_of(MyDDPStrategy()),
                  "model": _namespace.namespace_of(DigitsClassifier()),
                  "lightning_imported": "lightning" in sys.modules,
                  "pytorch_lightning_imported": "pytorch_lightning" in sys.modules}))
"""

#: A user's modules, imported in this order by one interpreter after ``import ddp_strategy`` (which loads both
#: namespaces); each sets ``result``. The first names no namespace; the others' imports choose.
_USER_MODULES = {
    "unnamed": """
from ddp_strategy import DigitsClassifier, MyDDPStrategy
from ddp_strategy._compat.namespace import namespace_of
strategy = MyDDPStrategy(timeout=5)  # at import time, nothing named: lightning
result = {"strategy": namespace_of(strategy), "model": namespace_of(DigitsClassifier())}
""",
    "uses_pl": """
import pickle
import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI
from ddp_strategy import DigitsClassifier, MyDDPStrategy
from ddp_strategy._compat.namespace import namespace_of
import unnamed

class Mine(MyDDPStrategy):
    pass

by_name = pl.Trainer(accelerator="cpu", devices=2, strategy="my_ddp", logger=False).strategy  # nothing built before
mine = pickle.loads(pickle.dumps(Mine(timeout=3)))
cli = LightningCLI(DigitsClassifier.for_namespace("pytorch_lightning"), run=False, args=[
    "--trainer.strategy=ddp_strategy.MyDDPStrategy", "--trainer.strategy.timeout=9", "--trainer.accelerator=cpu",
    "--trainer.devices=2", "--trainer.logger=false"])
taken = pl.Trainer(accelerator="cpu", devices=2, strategy=unnamed.strategy, logger=False).strategy
result = {"strategy": namespace_of(MyDDPStrategy()), "model": namespace_of(DigitsClassifier()),
          "my_ddp": namespace_of(by_name), "mine": [namespace_of(mine), isinstance(mine, Mine)],
          "cli": [namespace_of(cli.trainer.strategy), cli.trainer.strategy._options.timeout.total_seconds()],
          "unnamed_in_trainer": [namespace_of(taken), taken is unnamed.strategy]}
""",
    "uses_lightning": """
import lightning
from ddp_strategy import DigitsClassifier, MyDDPStrategy
from ddp_strategy._compat.namespace import namespace_of
from uses_pl import Mine, mine

by_name = lightning.Trainer(accelerator="cpu", devices=2, strategy="my_ddp", logger=False).strategy
taken = lightning.Trainer(accelerator="cpu", devices=2, strategy=mine, logger=False).strategy
result = {"strategy": namespace_of(MyDDPStrategy()), "model": namespace_of(DigitsClassifier()),
          "my_ddp": namespace_of(by_name),
          "mine_in_trainer": [namespace_of(taken), taken is mine, isinstance(mine, Mine)]}
""",
    "uses_both": """
import lightning, pytorch_lightning
from ddp_strategy import DigitsClassifier, MyDDPStrategy
from ddp_strategy._compat.namespace import namespace_of
result = {"strategy": namespace_of(MyDDPStrategy()), "model": namespace_of(DigitsClassifier())}
""",
}


@both
@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_users_imports_choose_the_namespace(tmp_path):
    """Fresh interpreters: the namespace the user's module imported (before or after ddp_strategy) wins; nothing
    named: lightning, which the other namespace's Trainer then takes over; DDP_STRATEGY_LIGHTNING overrides. A
    process that imports pytorch_lightning before ddp_strategy never imports lightning; ddp_strategy imported first
    loads both, so that "my_ddp" is in both registries."""
    pl_first = _fresh("import pytorch_lightning\n" + _REPORT)
    assert pl_first == {
        "strategy": "pytorch_lightning",
        "model": "pytorch_lightning",
        "lightning_imported": False,
        "pytorch_lightning_imported": True,
    }
    by_env = _fresh(_REPORT, env={"DDP_STRATEGY_LIGHTNING": "pytorch_lightning"})
    assert by_env == pl_first
    for name, source in _USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    results = _fresh(
        f"import importlib, json, sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport ddp_strategy\n"
        f"print(json.dumps({{m: importlib.import_module(m).result for m in {list(_USER_MODULES)}}}))"
    )
    pl, lightning = ("pytorch_lightning", "lightning")
    assert results == {
        "unnamed": {"strategy": lightning, "model": lightning},
        "uses_pl": {
            "strategy": pl,
            "model": pl,
            "my_ddp": pl,
            "mine": [pl, True],
            "cli": [pl, 9.0],
            "unnamed_in_trainer": [pl, True],
        },
        "uses_lightning": {
            "strategy": lightning,
            "model": lightning,
            "my_ddp": lightning,
            "mine_in_trainer": [lightning, True, True],
        },
        "uses_both": {"strategy": lightning, "model": lightning},
    }


def test_a_wrong_namespace_name_is_refused_with_the_choices(monkeypatch):
    """DDP_STRATEGY_LIGHTNING=<not a namespace> fails at construction, naming what to use; one that is not
    installed names the extra that installs it."""
    monkeypatch.setenv("DDP_STRATEGY_LIGHTNING", "lightining")
    with pytest.raises(ValueError, match="'lightning' or 'pytorch_lightning'"):
        MyDDPStrategy()
    monkeypatch.setenv("DDP_STRATEGY_LIGHTNING", "pytorch-lightning")  # the pip name works too
    if "pytorch_lightning" in INSTALLED:
        assert _namespace.namespace_of(MyDDPStrategy()) == "pytorch_lightning"
    else:  # the suggested fix: install it with our extra
        with pytest.raises(ModuleNotFoundError, match=r"pip install 'ddp_strategy\[pytorch-lightning\]'"):
            MyDDPStrategy()


def _launch(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run ``python ARGS`` in ``cwd`` as a user's process (its own session); its output, asserted to succeed."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**_user_environ(), **(env or {})},
    )
    code, log = finish(proc, 240)
    assert code == 0, log[-4000:]
    return log


@pytest.fixture(scope="module", params=INSTALLED)
def namespace_runs(request, tmp_path_factory) -> tuple[str, dict, Path, str]:
    """Per namespace: tests/scripts/namespace_fit.py, a user's 2-epoch fit (spawn) whose strategy was built for the
    other namespace (or where none is named); then the main job, DDP_STRATEGY_LIGHTNING=<it> python -m ddp_strategy
    fit, resuming the fit's epoch-0 checkpoint (popen). Returns the name, each rank's record (and the checkpoint
    folder), the main job's folder and its output."""
    name = request.param
    strategy_for = "pytorch_lightning" if name == "lightning" and len(INSTALLED) == 2 else "unnamed"
    base = tmp_path_factory.mktemp(f"runs_{name}")
    (fit := base / "fit").mkdir()
    _launch([str(SCRIPTS / "namespace_fit.py"), name, strategy_for, str(fit)], fit)
    full = {"dir": fit / "ckpts", **{r: torch.load(fit / f"rank{r}.pt", weights_only=True) for r in range(2)}}
    (main_job := base / "main_job").mkdir()
    log = _launch(
        [
            "-m",
            "ddp_strategy",
            "fit",
            f"--ckpt_path={full['dir'] / 'epoch=0.ckpt'}",
            "--seed_everything=321",
            "--trainer.strategy=ddp_strategy.MyDDPStrategy",
            "--trainer.strategy.verify_sync_every_n_steps=10",
            "--trainer.enable_progress_bar=false",
            "--trainer.max_epochs=2",
            "--trainer.limit_train_batches=10",
            "--trainer.limit_val_batches=2",
        ],
        main_job,
        env={_namespace.ENV_VAR: name, "PYTHONUNBUFFERED": "1"},
    )
    return name, full, main_job, log


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_checkpoint_and_resume_under_each_namespace(namespace_runs):
    """Under each namespace's Trainer (spawn): every object is that namespace's, the strategy too though built for
    the other (or for none); ranks end with equal weights; checkpoint keys are clean and load strictly into DigitsNet;
    the main job resuming it (popen, ranks checked in sync) ends with the uninterrupted run's weights."""
    name, full, main_job, _ = namespace_runs
    assert full[0]["built_for"] == next((n for n in INSTALLED if n != name), name)
    assert set(full[0]["namespaces"].values()) == {name}
    for key, value in full[0]["weights"].items():
        torch.testing.assert_close(full[1]["weights"][key], value, rtol=0, atol=0)
    assert sorted(p.name for p in full["dir"].iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    last = full["dir"] / "epoch=1.ckpt"
    checkpoint = load_file(last, weights_only=True)
    assert set(checkpoint["state_dict"]) == LIGHTNING_KEYS
    assert checkpoint["hyper_parameters"] == {"hidden_size": 128, "learning_rate": 1e-3, "weight_decay": 0.0}
    net = DigitsNet()
    net.load_state_dict(load_plain_state_dict(last), strict=True)
    lightning_model = DigitsClassifier.for_namespace(name)()
    lightning_model.load_state_dict(full[0]["weights"])
    with torch.no_grad():
        torch.testing.assert_close(net(probe_input()), lightning_model(probe_input()), rtol=0, atol=0)
    assert full[0]["val_acc"] > 0.3  # 20 steps from a 10-class chance of 0.1
    for rank in range(2):
        assert (full[rank]["epoch"], full[rank]["step"]) == (2, 20)
    (resumed,) = main_job.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert resumed.name == "epoch=1-step=20.ckpt"
    for key, value in load_file(resumed, weights_only=True)["state_dict"].items():
        torch.testing.assert_close(value, full[0]["weights"][key], rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_main_job_runs_on_the_namespace_chosen_by_the_environment(namespace_runs):
    """DDP_STRATEGY_LIGHTNING=<each namespace> python -m ddp_strategy fit: a 2-process fit, clean checkpoint."""
    _, _, main_job, log = namespace_runs
    assert "2 processes, backend=gloo" in log and "Final metrics" in log
    (ckpt,) = main_job.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert set(load_file(ckpt, weights_only=True)["state_dict"]) == LIGHTNING_KEYS
