"""Which Lightning the user runs: ``lightning`` (``lightning.pytorch``) or the standalone ``pytorch_lightning``.

The two hold the same code under two names with distinct classes, and ``pip install lightning`` (2.4 to 2.6)
installs both. This is the one module that imports either:

- **Loading.** ``import ddp_strategy`` loads the namespaces imported already, else the one
  ``DDP_STRATEGY_LIGHTNING`` names, else every one installed, and registers ``"my_ddp"`` in each (:func:`on_load`).
- **Flavours.** Our classes name their Lightning base by path (``lightning_base("pytorch.strategies:Strategy")``);
  ``MyDDPStrategy(...)`` builds an instance of the flavour ``type(name, (MyDDPStrategy, <that namespace's base>))``
  (:meth:`Flavoured.for_namespace`), which pickles as (public class, namespace). Where the base is an ABC the
  public class is registered with it in each namespace (for ``LightningCLI`` class paths and ``plugins=``).
- **Choice.** The class's own namespace, else that of a Lightning object among the arguments, else
  :func:`resolve`'s. A strategy handed to the other namespace's Trainer becomes that namespace's flavour.
"""

from __future__ import annotations

import abc
import copyreg
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import types
from functools import cache
from typing import Any, ClassVar

#: Environment variable naming the namespace to use: ``lightning`` or ``pytorch_lightning``.
ENV_VAR = "DDP_STRATEGY_LIGHTNING"
#: The two namespaces, the default first.
NAMESPACES: tuple[str, ...] = ("lightning", "pytorch_lightning")
#: Per namespace: the Trainer-level package and the Fabric-level package.
_ROOTS: dict[str, tuple[str, str]] = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}
#: Top-level package -> namespace.
_TOPS = {"lightning": "lightning", "pytorch_lightning": "pytorch_lightning", "lightning_fabric": "pytorch_lightning"}


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


def imported() -> tuple[str, ...]:
    """The installed namespaces whose Trainer-level package is in ``sys.modules`` (imported by anyone)."""
    return tuple(name for name in installed() if _ROOTS[name][0] in sys.modules)


def _check_name(name: str, source: str) -> str:
    canonical = name.strip().replace("-", "_")
    if canonical not in NAMESPACES:
        raise ValueError(
            f"{source} is {name!r}, which is not a Lightning namespace: use 'lightning' or 'pytorch_lightning'."
        )
    if canonical not in installed():
        raise ModuleNotFoundError(
            f"{source} is {name!r}, but {canonical} is not installed (installed: {list(installed()) or 'none'})."
            f" Install it with pip install 'ddp_strategy[{canonical.replace('_', '-')}]', or choose an installed one."
        )
    return canonical


def _chosen_by_variable() -> str | None:
    choice = os.environ.get(ENV_VAR, "").strip()
    return _check_name(choice, f"the environment variable {ENV_VAR}") if choice else None


def _namespace_of_module(module: Any) -> str | None:
    return _TOPS.get(str(module).partition(".")[0]) if module else None


def _caller_namespace() -> str | None:
    """The namespace of the nearest caller outside ``ddp_strategy`` that uses one: Lightning's own code, or a
    module whose globals hold modules, classes or functions of exactly one namespace."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        found = not module.startswith("ddp_strategy") and (
            {_namespace_of_module(module)} - {None}
            or {
                _namespace_of_module(value.__name__ if isinstance(value, types.ModuleType) else value.__module__)
                for value in list(frame.f_globals.values())
                if isinstance(value, (types.ModuleType, type, types.FunctionType))
            }
            - {None}
        )
        if found:
            return found.pop() if len(found) == 1 else None
        frame = frame.f_back
    return None


def resolve() -> str:
    """The namespace for a new object: ``DDP_STRATEGY_LIGHTNING``; else the only one installed; else the one the
    nearest caller uses (the user's module that did ``import pytorch_lightning as pl``, or Lightning's own
    registry, ``LightningCLI`` or Trainer); else the only one imported; else :data:`default`'s.

    Raises:
        ValueError: ``DDP_STRATEGY_LIGHTNING`` names no namespace.
        ModuleNotFoundError: it names one that is not installed, or neither is installed.
    """
    chosen = _chosen_by_variable()  # raises for a wrong name, so a name chosen is installed
    if not installed():
        raise ModuleNotFoundError(
            "ddp_strategy needs Lightning, and neither lightning nor pytorch_lightning is"
            " installed: pip install 'ddp_strategy[lightning]' (or"
            " 'ddp_strategy[pytorch-lightning]' for import pytorch_lightning)."
        )
    return (
        chosen
        or (installed()[0] if len(installed()) == 1 else None)
        or _caller_namespace()
        or (imported()[0] if len(imported()) == 1 else None)
        or default.name
    )


class Namespace:
    """One Lightning namespace, imported.

    Args:
        name: ``"lightning"`` or ``"pytorch_lightning"``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.pytorch, self.fabric = map(importlib.import_module, _ROOTS[name])
        self.version: str = str(self.pytorch.__version__)  #: the installed version, e.g. ``"2.6.6"``

    def get(self, path: str) -> Any:
        """The object at ``path``: ``"<pytorch|fabric>.<module>:<attribute>"``, e.g.
        ``"pytorch.strategies:ParallelStrategy"``; no attribute gives the module."""
        level = re.split("[.:]", path, maxsplit=1)[0]
        return pkgutil.resolve_name(
            {"pytorch": self.pytorch, "fabric": self.fabric}[level].__name__ + path[len(level) :]
        )

    def __repr__(self) -> str:
        return f"Namespace({self.name!r})"


_LOADED: dict[str, Namespace] = {}
_ON_LOAD: list[Any] = []


def load(name: str) -> Namespace:
    """The namespace ``name``, imported on first use; runs the :func:`on_load` registrations for it."""
    if name not in _LOADED:
        _LOADED[name] = Namespace(name)
        for callback in list(_ON_LOAD):
            callback(_LOADED[name])
    return _LOADED[name]


def on_load(callback: Any) -> None:
    """Call ``callback(namespace)`` for every namespace loaded now and later (to register with each)."""
    _ON_LOAD.append(callback)
    for namespace in list(_LOADED.values()):
        callback(namespace)


def namespace_of(obj: Any) -> str | None:
    """The namespace ``obj`` (an object or a class) belongs to, from its class's modules; None if neither."""
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "_ddp_namespace", None) or next(
        filter(None, (_namespace_of_module(getattr(k, "__module__", "")) for k in cls.__mro__)), None
    )


# ----------------------------------------------------------------------------------- flavoured classes
class Flavoured:
    """A class of ours derived from a Lightning class named by path (use :func:`lightning_base`); its instances
    are of a per-namespace flavour."""

    _ddp_base: ClassVar[str]
    #: Set on flavours (and inherited by user subclasses of a flavour); None on public classes.
    _ddp_namespace: ClassVar[str | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._ddp_namespace is None:
            found = {namespace_of(value) for value in (*args, *kwargs.values())} - {None}
            cls = cls.for_namespace(found.pop() if len(found) == 1 else resolve())
        for name in imported():  # a namespace imported after ddp_strategy: register "my_ddp" there too
            load(name)
        return super(Flavoured, cls).__new__(cls)  # noqa: UP008 (cls is the flavour now)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A flavour has the public class's name, so pickle cannot find it by name: rebuild it from the public
        # class (pickled by name) and the namespace. ``spawn`` and ``forkserver`` pickle the trainer this way.
        reduced = super().__reduce_ex__(protocol)
        cls = type(self)
        if "_ddp_namespace" in cls.__dict__ and reduced[0] is copyreg.__newobj__ and reduced[1][0] is cls:
            return (_new_flavour, (cls.__bases__[0], cls._ddp_namespace, *reduced[1][1:]), *reduced[2:])
        return reduced

    @classmethod
    def for_namespace(cls, name: str) -> type:
        """This class built on ``name``'s Lightning, made once: a subclass of ``cls`` and that namespace's base
        (``MyDDPStrategy.for_namespace("pytorch_lightning")(...)`` chooses explicitly).

        Raises:
            ValueError, ModuleNotFoundError: ``name`` is not an installed namespace.
            TypeError: ``cls`` subclasses the flavour of another namespace.
        """
        name = _check_name(name, "the namespace")
        if cls._ddp_namespace == name:
            return cls
        if cls._ddp_namespace is not None and "_ddp_namespace" not in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} subclasses the {cls._ddp_namespace} flavour of a ddp_strategy"
                f" class, so it cannot be built for {name}; subclass the public class instead."
            )
        return _flavour(cls.__bases__[0] if cls._ddp_namespace else cls, name)


@cache
def _flavour(public: type, name: str) -> type:
    """The flavour of the public class ``public`` for namespace ``name``, made once."""
    namespace = load(name)
    base = namespace.get(public._ddp_base)  # type: ignore[attr-defined]
    mixins = tuple(mixin for path, mixin in MIXINS if issubclass(base, namespace.get(path)))
    return type(base)(
        public.__name__,
        (public, *mixins, base),
        {
            "__module__": public.__module__,
            "__qualname__": public.__qualname__,
            "__doc__": public.__doc__,
            "_ddp_namespace": name,
        },
    )


def _new_flavour(public: type, name: str, *args: Any) -> Any:
    """Unpickling: a new, empty instance of the flavour of ``public`` for namespace ``name``."""
    return copyreg.__newobj__(public.for_namespace(name), *args)  # type: ignore[attr-defined]


def lightning_base(path: str) -> type:
    """A :class:`Flavoured` base standing for the Lightning class at ``path`` (see :meth:`Namespace.get`) in
    whichever namespace the user runs: ``class MyDDPStrategy(lightning_base(...))``."""

    def load_from_checkpoint(cls: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, on the flavour of ``cls`` for :func:`resolve`'s namespace."""
        return super(base, cls.for_namespace(cls._ddp_namespace or resolve())).load_from_checkpoint(*args, **kwargs)

    body: dict[str, Any] = {"_ddp_base": path, "__module__": __name__}
    if hasattr(default.get(path), "load_from_checkpoint"):  # LightningModule, LightningDataModule
        body["load_from_checkpoint"] = classmethod(load_from_checkpoint)
    base = type(f"LightningBase[{path}]", (Flavoured,), body)

    def register(namespace: Namespace) -> None:
        if isinstance(namespace.get(path), abc.ABCMeta):
            namespace.get(path).register(base)

    on_load(register)
    return base


class _FollowsTheTrainer:
    """Mixed into strategy flavours: the other namespace's Trainer (it sets ``strategy.accelerator`` first, in 2.4,
    2.5 and 2.6) makes the strategy, the same object, its own flavour. ``__init__`` is not re-run: what it made is
    namespace-neutral; Lightning objects the user passed are kept as given, as Lightning's DDPStrategy keeps them."""

    @property
    def accelerator(self) -> Any:
        return super().accelerator  # type: ignore[misc]

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        theirs = namespace_of(accelerator)
        if theirs is not None and theirs != type(self)._ddp_namespace:
            self.__class__ = type(self).for_namespace(theirs)
        super(_FollowsTheTrainer, type(self)).accelerator.__set__(self, accelerator)  # type: ignore[misc]


#: (path of a Lightning class, mixin for flavours whose base derives from it), in MRO order;
#: :mod:`~ddp_strategy._compat.lightning_private` adds its ``SavesPublicInitArgs`` when imported (with the package).
MIXINS: list[tuple[str, type]] = [("pytorch.strategies:Strategy", _FollowsTheTrainer)]


def any_namespace(path: str) -> type:
    """A class for ``isinstance`` checks: true for the class at ``path`` (see :meth:`Namespace.get`) of any
    namespace imported."""

    def hook(cls: type, sub: type) -> bool:
        return any(issubclass(sub, load(name).get(path)) for name in imported()) or NotImplemented

    return type(path.rpartition(":")[2], (abc.ABC,), {"__subclasshook__": classmethod(hook), "__module__": __name__})


def _load_at_import() -> Namespace:
    chosen = _chosen_by_variable()
    names = imported() or ([chosen] if chosen else installed())
    for name in names:
        load(name)
    return load(chosen or (names[0] if names else resolve()))  # resolve() raises: nothing installed


#: The namespace of the namespace-neutral helpers.
default: Namespace = _load_at_import()

#: ``isinstance`` checks that hold for either namespace's class.
SIGTERMException = any_namespace("pytorch.utilities.exceptions:SIGTERMException")
LightningModule = any_namespace("pytorch:LightningModule")

# Namespace-neutral helpers, from the default namespace (the same functions and equal enums in both).
rank_zero_info = default.get("pytorch.utilities.rank_zero:rank_zero_info")
rank_zero_warn = default.get("pytorch.utilities.rank_zero:rank_zero_warn")
rank_zero_only = default.get("pytorch.utilities.rank_zero:rank_zero_only")
reset_seed = default.get("fabric.utilities.seed:reset_seed")
get_filesystem = default.get("fabric.utilities.cloud_io:get_filesystem")
lightning_getattr = default.get("pytorch.utilities.parsing:lightning_getattr")
lightning_hasattr = default.get("pytorch.utilities.parsing:lightning_hasattr")
sized_len = default.get("fabric.utilities.data:sized_len")
isolate_rng = default.get("pytorch.utilities.seed:isolate_rng")
TrainerFn = default.get("pytorch.trainer.states:TrainerFn")
RunningStage = default.get("pytorch.trainer.states:RunningStage")
