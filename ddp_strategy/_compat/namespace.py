"""Which Lightning the user runs: ``lightning`` (``lightning.pytorch``) or the standalone ``pytorch_lightning``.

The two hold the same code under two names with distinct classes, and ``pip install lightning`` (2.4 to 2.6)
installs both. This is the one module that imports either. The namespace is chosen once per process, when
``ddp_strategy`` is imported (:data:`NAME`, by :func:`resolve`), and every class of ours that derives from a
Lightning class derives from that namespace's (``get("pytorch.strategies:ParallelStrategy")``), so our objects are
plain Lightning objects of one namespace: they pickle, ``save_hyperparameters`` and ``LightningCLI`` class paths
work as for any. ``"my_ddp"`` is registered in that namespace's registry (docs/compatibility.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pkgutil
import re
import sys
from functools import cache
from typing import TYPE_CHECKING, Any

#: Environment variable naming the namespace to use: ``lightning`` or ``pytorch_lightning``.
ENV_VAR = "DDP_STRATEGY_LIGHTNING"
#: The two namespaces, the default first.
NAMESPACES: tuple[str, ...] = ("lightning", "pytorch_lightning")
#: Per namespace: the Trainer-level package and the Fabric-level package.
_ROOTS: dict[str, tuple[str, str]] = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}
#: An import of either namespace: ``import lightning as L``, ``from pytorch_lightning import``, ``import os, lightning``
_IMPORT = re.compile(r"^[ \t]*(?:from|import)[ \t][^\n#]*?(?<![.\w])(pytorch_lightning|lightning)\b", re.MULTILINE)


def _found(top: str, sub: str = "") -> bool:
    # find_spec("lightning.pytorch") would import the package "lightning": look for the folder instead.
    spec = importlib.util.find_spec(top)
    return spec is not None and (
        not sub or any(os.path.isdir(os.path.join(loc, sub)) for loc in spec.submodule_search_locations or ())
    )


@cache
def installed() -> tuple[str, ...]:
    """The namespaces installed (found by ``importlib.util.find_spec``, nothing imported), default first."""
    return tuple(name for name in NAMESPACES if _found(*_ROOTS[name][0].split(".")))


def _sources_import() -> set[str]:
    """The namespaces the source imports of the ``__main__`` script and of the module whose import statement
    imported ``ddp_strategy`` (the nearest caller outside it and ``importlib``; a spawned rank's script too); none in
    a REPL or notebook, or where unreadable."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(("ddp_strategy", "importlib")):
        frame = frame.f_back
    found: set[str] = set()
    for path in {getattr(sys.modules.get("__main__"), "__file__", None) or "", frame.f_code.co_filename}:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(path, encoding="utf-8") as source:
            found.update(_IMPORT.findall(source.read()))
    return found


def resolve() -> str:
    """The namespace of this process, first that applies: ``DDP_STRATEGY_LIGHTNING``; the only one the ``__main__``
    script and the module importing ``ddp_strategy`` import (:func:`_sources_import`: so ``import ddp_strategy`` may
    come before ``import pytorch_lightning``, in the script or in the training module that imports ``ddp_strategy``);
    the only one imported
    already; the only one installed; else ``lightning``.

    Raises:
        ValueError: ``DDP_STRATEGY_LIGHTNING`` names no namespace.
        ModuleNotFoundError: it names one that is not installed, or neither is installed.
    """
    chosen = os.environ.get(ENV_VAR, "").strip().replace("-", "_")
    if chosen and chosen not in NAMESPACES:
        raise ValueError(
            f"The environment variable {ENV_VAR} is {os.environ[ENV_VAR]!r}, which is not a Lightning namespace: use"
            " 'lightning' or 'pytorch_lightning'."
        )
    if not installed() or chosen and chosen not in installed():
        extra = (chosen or NAMESPACES[0]).replace("_", "-")
        raise ModuleNotFoundError(
            f"ddp_strategy needs Lightning{f' ({ENV_VAR}={chosen})' if chosen else ''}, and it is not installed"
            f" (installed: {list(installed()) or 'none'}): pip install 'ddp_strategy[{extra}]', or choose an"
            " installed one."
        )
    script = [name for name in installed() if name in _sources_import()]
    imported = [name for name in installed() if _ROOTS[name][0] in sys.modules]
    for found in ([chosen] if chosen else [], script, imported, list(installed())):
        if len(found) == 1:
            return found[0]
    return NAMESPACES[0]


#: This process's namespace: ``"lightning"`` or ``"pytorch_lightning"`` (its ranks, running its code, choose alike).
NAME: str = resolve()


def get(path: str, name: str | None = None) -> Any:
    """The object at ``path``, ``"<pytorch|fabric>.<module>:<attribute>"`` (no attribute: the module), e.g.
    ``"pytorch.strategies:ParallelStrategy"``, in namespace ``name`` (default :data:`NAME`; another is imported).

    Raises:
        ImportError, AttributeError: nothing at ``path``.
    """
    level = re.split("[.:]", path, maxsplit=1)[0]
    return pkgutil.resolve_name(_ROOTS[name or NAME][level == "fabric"] + path[len(level) :])


#: The installed version of that namespace, e.g. ``"2.6.6"``.
version: str = get("pytorch:__version__")
# Helpers and classes of this process's namespace.
rank_zero_info = get("pytorch.utilities.rank_zero:rank_zero_info")
rank_zero_warn = get("pytorch.utilities.rank_zero:rank_zero_warn")
rank_zero_only = get("pytorch.utilities.rank_zero:rank_zero_only")
reset_seed = get("fabric.utilities.seed:reset_seed")
get_filesystem = get("fabric.utilities.cloud_io:get_filesystem")
lightning_getattr = get("pytorch.utilities.parsing:lightning_getattr")
lightning_hasattr = get("pytorch.utilities.parsing:lightning_hasattr")
sized_len = get("fabric.utilities.data:sized_len")
isolate_rng = get("pytorch.utilities.seed:isolate_rng")
TrainerFn = get("pytorch.trainer.states:TrainerFn")
RunningStage = get("pytorch.trainer.states:RunningStage")
SIGTERMException = get("pytorch.utilities.exceptions:SIGTERMException")
# The base classes the package subclasses (``class X(_namespace.Callback)``), typed as Lightning's for mypy.
if TYPE_CHECKING:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch import Callback, LightningDataModule, LightningModule
    from lightning.pytorch.strategies import ParallelStrategy
else:
    Callback = get("pytorch.callbacks:Callback")
    LightningModule = get("pytorch:LightningModule")
    LightningDataModule = get("pytorch:LightningDataModule")
    ParallelStrategy = get("pytorch.strategies:ParallelStrategy")
    TorchCheckpointIO = get("fabric.plugins.io.torch_io:TorchCheckpointIO")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie too; a process of another user included)."""
    try:
        os.kill(pid, 0)
    except OSError as e:  # PermissionError: alive, another user's
        return not isinstance(e, ProcessLookupError)
    return True
