"""Which Lightning namespace to use, loading it, and the namespace-neutral helpers taken from it.

See :mod:`ddp_strategy._compat.namespace` for the whole story; this module is its lower half: :func:`resolve`
picks ``lightning`` or ``pytorch_lightning``, :func:`load` imports one (and runs the :func:`on_load`
registrations), an import hook loads a namespace the user imports later, and :data:`default` gives
``rank_zero_info``, ``TrainerFn``, ``reset_seed``, ... No namespace that is not installed is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
from functools import cache
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


#: Environment variable naming the namespace to use: ``lightning`` or ``pytorch_lightning``.
ENV_VAR = "DDP_STRATEGY_LIGHTNING"
#: The two namespaces, the default first.
NAMESPACES: tuple[str, ...] = ("lightning", "pytorch_lightning")
#: Per namespace: the Trainer-level package and the Fabric-level package.
_ROOTS: dict[str, tuple[str, str]] = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}
#: The pip extra of ``ddp_strategy`` that installs each namespace.
_EXTRAS = {"lightning": "lightning", "pytorch_lightning": "pytorch-lightning"}


@cache
def installed() -> tuple[str, ...]:
    """The namespaces installed (found by ``importlib.util.find_spec``, nothing imported), default first."""
    found = []
    for name in NAMESPACES:
        # find_spec("lightning.pytorch") would import the package "lightning": look for the folder instead.
        top, _, sub = _ROOTS[name][0].partition(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        locations = (spec.submodule_search_locations or []) if spec is not None else []
        if spec is not None and (not sub or any(os.path.isdir(os.path.join(loc, sub)) for loc in locations)):
            found.append(name)
    return tuple(found)


def imported() -> tuple[str, ...]:
    """The namespaces whose Trainer-level package is in ``sys.modules`` (imported by anyone)."""
    return tuple(name for name in NAMESPACES if _ROOTS[name][0] in sys.modules)


#: Namespaces that ``ddp_strategy`` imported itself (not evidence of what the user runs).
_SELF_IMPORTED: set[str] = set()


def _check_name(name: str, source: str) -> str:
    canonical = name.strip().replace("-", "_")
    if canonical not in NAMESPACES:
        raise ValueError(f"{source} is {name!r}, which is not a Lightning namespace: use 'lightning' or"
                         " 'pytorch_lightning'.")
    if canonical not in installed():
        raise ModuleNotFoundError(
            f"{source} is {name!r}, but {canonical} is not installed (installed: {list(installed()) or 'none'})."
            f" Install it with pip install 'ddp_strategy[{_EXTRAS[canonical]}]', or choose an installed one.")
    return canonical


def resolve() -> str:
    """The namespace a new object is built for when nothing more specific says (see the module docstring).

    Returns:
        ``"lightning"`` or ``"pytorch_lightning"``.

    Raises:
        ValueError: ``DDP_STRATEGY_LIGHTNING`` names no namespace.
        ModuleNotFoundError: it names one that is not installed, or neither is installed.
    """
    choice = os.environ.get(ENV_VAR, "").strip()
    if choice:
        return _check_name(choice, f"the environment variable {ENV_VAR}")
    available = installed()
    if not available:
        raise ModuleNotFoundError("ddp_strategy needs Lightning, and neither lightning nor pytorch_lightning is"
                                  " installed: pip install 'ddp_strategy[lightning]' (or"
                                  " 'ddp_strategy[pytorch-lightning]' for import pytorch_lightning).")
    if len(available) == 1:
        return available[0]
    users = [name for name in imported() if name not in _SELF_IMPORTED]
    if len(users) == 1:
        return users[0]
    return default.name if "default" in globals() else NAMESPACES[0]


class Namespace:
    """One Lightning namespace, imported.

    Args:
        name: ``"lightning"`` or ``"pytorch_lightning"``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.pytorch_name, self.fabric_name = _ROOTS[name]
        self.pytorch: ModuleType = importlib.import_module(self.pytorch_name)
        self.fabric: ModuleType = importlib.import_module(self.fabric_name)

    @property
    def version(self) -> str:
        """The installed version, e.g. ``"2.6.6"``."""
        return str(sys.modules[self.pytorch_name.partition(".")[0]].__version__)

    def get(self, path: str) -> Any:
        """The object at ``path`` in this namespace.

        Args:
            path: ``"<level>.<module>:<attribute>"`` with level ``pytorch`` or ``fabric``, e.g.
                ``"pytorch.strategies:ParallelStrategy"`` is ``lightning.pytorch.strategies.ParallelStrategy``
                or ``pytorch_lightning.strategies.ParallelStrategy``; no attribute gives the module.
        """
        module_path, _, attribute = path.partition(":")
        level, _, rest = module_path.partition(".")
        root = {"pytorch": self.pytorch_name, "fabric": self.fabric_name}[level]
        obj: Any = importlib.import_module(f"{root}.{rest}" if rest else root)
        for part in filter(None, attribute.split(".")):
            obj = getattr(obj, part)
        return obj

    def __repr__(self) -> str:
        return f"Namespace({self.name!r})"


_LOADED: dict[str, Namespace] = {}
_ON_LOAD: list[Any] = []


def load(name: str) -> Namespace:
    """The namespace ``name``, imported on first use; registers our classes with it (see :func:`on_load`)."""
    namespace = _LOADED.get(name)
    if namespace is None:
        namespace = _LOADED[name] = Namespace(name)
        for callback in list(_ON_LOAD):
            callback(namespace)
    return namespace


def sync() -> None:
    """Run the :func:`on_load` registrations for every namespace imported since (by the user, say)."""
    for name in imported():
        if name in installed():
            load(name)


def on_load(callback: Any) -> None:
    """Call ``callback(namespace)`` for every namespace loaded now and later (to register with each)."""
    _ON_LOAD.append(callback)
    for namespace in list(_LOADED.values()):
        callback(namespace)


class _LoadOnImport(importlib.abc.MetaPathFinder):
    """When a namespace is imported after ``ddp_strategy``, load it (register ``"my_ddp"`` and our ABCs).

    Without this, ``import ddp_strategy`` then ``import pytorch_lightning`` (with both installed) would leave
    ``pytorch_lightning.Trainer(strategy="my_ddp")`` unregistered until one of our objects is built.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        names = {roots[0]: name for name, roots in _ROOTS.items()}
        if fullname not in names or names[fullname] in _LOADED:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LoadAfter(spec.loader, names[fullname])
        return spec


class _LoadAfter(importlib.abc.Loader):
    """Wraps a namespace's loader: execute the module as usual, then :func:`load` the namespace."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            load(self._name)
        except Exception as e:  # never break the user's import; our objects register on construction anyway
            log.debug("could not register with %s after its import: %s", self._name, e)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


# ------------------------------------------------------------------------------ the default namespace
def _load_default() -> Namespace:
    name = resolve()
    if _ROOTS[name][0] not in sys.modules:
        _SELF_IMPORTED.add(name)
    return load(name)


#: The namespace imported with ``ddp_strategy``, for namespace-neutral helpers.
default: Namespace = _load_default()
if not any(isinstance(finder, _LoadOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _LoadOnImport())

# Namespace-neutral helpers, from the default namespace (the same functions and equal enums in both).
rank_zero_info = default.get("pytorch.utilities.rank_zero:rank_zero_info")
rank_zero_warn = default.get("pytorch.utilities.rank_zero:rank_zero_warn")
rank_zero_only = default.get("pytorch.utilities.rank_zero:rank_zero_only")
reset_seed = default.get("fabric.utilities.seed:reset_seed")
get_filesystem = default.get("fabric.utilities.cloud_io:get_filesystem")
lightning_getattr = default.get("pytorch.utilities.parsing:lightning_getattr")
lightning_hasattr = default.get("pytorch.utilities.parsing:lightning_hasattr")
TrainerFn = default.get("pytorch.trainer.states:TrainerFn")
RunningStage = default.get("pytorch.trainer.states:RunningStage")
