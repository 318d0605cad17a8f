"""Lightning's two namespaces, ``lightning.pytorch`` and ``pytorch_lightning``: one per process, chosen when
``ddp_strategy`` is imported (``ddp_strategy._compat.namespace.resolve``), our classes derive from its classes."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
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


def test_our_classes_derive_from_the_process_namespace():
    """Each of our Lightning-derived classes is a subclass of this process's namespace's class, not the other's."""
    other = [name for name in INSTALLED if name != _namespace.NAME]
    for ours, base, args in (
        (MyDDPStrategy, "pytorch.strategies:ParallelStrategy", {}),
        (DigitsClassifier, "pytorch:LightningModule", {}),
        (DigitsDataModule, "pytorch:LightningDataModule", {}),
        (DDPCheckpointIO, "fabric.plugins:CheckpointIO", {}),
        (
            EpochBoundaryCheck,
            "pytorch:Callback",
            {"run": None, "gloo": True, "rank": 0, "begin_epoch": print, "step_round": None},
        ),
    ):
        obj = ours(**args)
        assert isinstance(obj, _namespace.get(base))
        assert not any(isinstance(obj, _namespace.get(base, name)) for name in other)


def test_strategy_names_and_plugins_are_accepted_by_the_trainer():
    """Trainer(strategy="my_ddp") gives MyDDPStrategy; Trainer(plugins=[DDPCheckpointIO()]) uses it; the strategy's
    repr names its namespace (Lightning's refusal of a strategy of the other namespace shows it)."""
    io = DDPCheckpointIO()
    trainer = _namespace.get("pytorch:Trainer")(
        accelerator="cpu", devices=2, strategy="my_ddp", plugins=[io], logger=False
    )
    assert isinstance(trainer.strategy, MyDDPStrategy)
    assert trainer.strategy.checkpoint_io is io
    assert f"for {_namespace.NAME}" in repr(trainer.strategy) and _namespace.ENV_VAR in repr(trainer.strategy)


class SubClassifier(DigitsClassifier):
    """A user's subclass with one more hyper-parameter."""

    def __init__(self, extra: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


def test_save_hyperparameters_collects_our_init_arguments(tmp_path):
    """hparams hold every __init__ argument (ours and a user subclass's), and load_from_checkpoint rebuilds them."""
    model = DigitsClassifier(hidden_size=8)
    assert dict(model.hparams) == {"hidden_size": 8, "learning_rate": 1e-3, "weight_decay": 0.0}
    sub = SubClassifier(extra=5, hidden_size=4)
    assert dict(sub.hparams) == {"extra": 5, "hidden_size": 4, "learning_rate": 1e-3, "weight_decay": 0.0}
    assert DigitsDataModule(batch_size=16).hparams["batch_size"] == 16
    path = tmp_path / "sub.ckpt"
    torch.save(
        {
            "state_dict": sub.state_dict(),
            sub.CHECKPOINT_HYPER_PARAMS_KEY: dict(sub.hparams),
            "pytorch-lightning_version": _namespace.version,
        },
        path,
    )
    loaded = SubClassifier.load_from_checkpoint(path)
    assert isinstance(loaded, SubClassifier) and dict(loaded.hparams) == dict(sub.hparams)
    assert loaded.model.layers[0].out_features == 4


def test_our_objects_pickle():
    """spawn pickles the trainer: our objects come back as the same classes, with their state."""
    for obj in (MyDDPStrategy(timeout=7), DigitsClassifier(hidden_size=8)):
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


def _fresh_script(path: Path) -> dict:
    """Run the script at ``path`` as ``python path`` in a fresh interpreter; it prints one JSON line, returned."""
    return _fresh(f"import runpy, sys\nsys.argv = [{str(path)!r}]\nrunpy.run_path({str(path)!r}, run_name='__main__')")


_REPORT = """
import json, sys
from ddp_strategy import DigitsClassifier, MyDDPStrategy
from ddp_strategy._compat import namespace as _namespace
bases = [c.__module__ for c in type(MyDDPStrategy()).__mro__ if c.__name__ == "ParallelStrategy"]
print(json.dumps({"namespace": _namespace.NAME, "strategy_base": bases[0].split(".")[0],
                  "lightning_imported": "lightning" in sys.modules,
                  "pytorch_lightning_imported": "pytorch_lightning" in sys.modules}))
"""

#: A user's script that imports ddp_strategy *before* its Lightning namespace (alphabetical ``from`` imports), then
#: builds a Trainer with our strategy, by object and by name, and the LightningCLI with our class path.
_SCRIPT = """
import json, sys
from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy
from {namespace} import Trainer
from {namespace}.cli import LightningCLI

by_object = Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(timeout=5), logger=False).strategy
by_name = Trainer(accelerator="cpu", devices=2, strategy="my_ddp", logger=False).strategy
other_imported = {other!r} in sys.modules  # (jsonargparse imports it, to read our type hints)
cli = LightningCLI(DigitsClassifier, DigitsDataModule, run=False, args=[
    "--trainer.strategy=ddp_strategy.MyDDPStrategy", "--trainer.strategy.timeout=9", "--trainer.accelerator=cpu",
    "--trainer.devices=2", "--trainer.logger=false"])
print(json.dumps({{"by_object": by_object._options.timeout.total_seconds(), "by_name": type(by_name).__name__,
                  "cli": cli.trainer.strategy._options.timeout.total_seconds(),
                  "other_imported": other_imported}}))
"""


@both
@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_users_imports_choose_the_namespace(tmp_path):
    """Fresh interpreters: the imports of the script, or of the training module that imports ddp_strategy (the script
    itself importing no Lightning), choose, before or after ddp_strategy's (the other namespace is never imported),
    `import os, pytorch_lightning` too; else the namespace imported already; else lightning; DDP_STRATEGY_LIGHTNING
    overrides; a process that imported ddp_strategy leaves the choice of the scripts it starts to them. Where nothing
    names pytorch_lightning before ddp_strategy is imported (a notebook, ``python -c``), its Trainer refuses our
    strategy and names the variable that fixes it, which works."""
    expected = {"by_object": 5.0, "by_name": "MyDDPStrategy", "cli": 9.0, "other_imported": False}
    for namespace, other in (("pytorch_lightning", "lightning"), ("lightning.pytorch", "pytorch_lightning")):
        script = tmp_path / f"train_{namespace}.py"
        script.write_text(_SCRIPT.format(namespace=namespace, other=other))
        assert _fresh_script(script) == expected
    (tmp_path / "mytrain.py").write_text(
        _SCRIPT.format(namespace="pytorch_lightning", other="lightning").replace(
            "from pytorch_lightning import Trainer", "import os, pytorch_lightning\nTrainer = pytorch_lightning.Trainer"
        )
    )
    (run := tmp_path / "run.py").write_text(
        "import sys\nsys.path.insert(0, sys.argv[0].rpartition('/')[0])\nimport mytrain\n"
    )
    assert _fresh_script(run) == expected  # the training module, not the script, imports Lightning
    child = str(tmp_path / "train_pytorch_lightning.py")
    driver = (
        "import ddp_strategy, json, subprocess, sys\n"
        f"out = subprocess.run([sys.executable, {child!r}], capture_output=True, text=True).stdout\n"
        "print(out.splitlines()[-1])"
    )
    assert _fresh(driver) == expected  # the child chooses by its own imports
    pl_first = _fresh("import pytorch_lightning\n" + _REPORT)
    assert pl_first == {
        "namespace": "pytorch_lightning",
        "strategy_base": "pytorch_lightning",
        "lightning_imported": False,
        "pytorch_lightning_imported": True,
    }
    assert _fresh(_REPORT, env={"DDP_STRATEGY_LIGHTNING": "pytorch_lightning"}) == pl_first
    assert (
        _fresh(_REPORT)["namespace"]
        == _fresh("import lightning, pytorch_lightning\n" + _REPORT)["namespace"]
        == "lightning"
    )
    late = (
        "import ddp_strategy, pytorch_lightning as pl\npl.Trainer(strategy=ddp_strategy.MyDDPStrategy(), logger=False)"
    )
    with pytest.raises(AssertionError, match=r"strategy=<MyDDPStrategy for lightning \(DDP_STRATEGY_LIGHTNING="):
        _fresh(late)
    _fresh(late + "\nprint('{}')", env={"DDP_STRATEGY_LIGHTNING": "pytorch_lightning"})


def test_a_wrong_namespace_name_is_refused_with_the_choices():
    """DDP_STRATEGY_LIGHTNING=<not a namespace> fails at import, naming what to use; the pip name works too."""
    with pytest.raises(AssertionError, match="'lightning' or 'pytorch_lightning'"):
        _fresh(_REPORT, env={"DDP_STRATEGY_LIGHTNING": "lightining"})
    if "pytorch_lightning" in INSTALLED:
        assert _fresh(_REPORT, env={"DDP_STRATEGY_LIGHTNING": "pytorch-lightning"})["namespace"] == "pytorch_lightning"


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
    """Per namespace: tests/scripts/namespace_fit.py, a user's 2-epoch fit (spawn) that imports ddp_strategy before
    its namespace; then the main job, DDP_STRATEGY_LIGHTNING=<it> python -m ddp_strategy fit, resuming the fit's
    epoch-0 checkpoint (popen). Returns the name, each rank's record (and the checkpoint folder), the main job's
    folder and its output."""
    name = request.param
    base = tmp_path_factory.mktemp(f"runs_{name}")
    (fit := base / "fit").mkdir()
    script = (SCRIPTS / "namespace_fit.py").read_text()
    if name == "pytorch_lightning":  # the user's script imports its one namespace
        script = script.replace("import lightning.pytorch as pl", "import pytorch_lightning as pl")
    (fit / "train.py").write_text(script)
    _launch([str(fit / "train.py"), str(fit)], fit)
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
    """Under each namespace's Trainer (spawn): every object of ours is that namespace's; ranks end with equal weights;
    checkpoint keys are clean and load strictly into DigitsNet; the main job resuming it (popen, ranks checked in
    sync) ends with the uninterrupted run's weights."""
    name, full, main_job, _ = namespace_runs
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
    lightning_model = DigitsClassifier()
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
    assert "MyDDPStrategy: world size 2, backend=gloo" in log and "Final metrics" in log
    (ckpt,) = main_job.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert set(load_file(ckpt, weights_only=True)["state_dict"]) == LIGHTNING_KEYS
