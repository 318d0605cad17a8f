"""Which Lightning the user runs: ``lightning`` (``lightning.pytorch``) or the standalone ``pytorch_lightning``.

The two packages hold the same code under two names, and their classes are distinct objects: a
``pytorch_lightning.Trainer`` refuses a strategy that subclasses ``lightning.pytorch``'s ``Strategy`` and
a module that subclasses ``lightning.pytorch``'s ``LightningModule``. ``pip install lightning`` (2.4 to 2.6)
installs both. This module is the one place that imports either, so that the rest of the package is
written once:

- every class of ours that derives from a Lightning class declares its base by *path*
  (``class MyDDPStrategy(lightning_base("pytorch.strategies:ParallelStrategy"))``); the class the user
  names is namespace-free, and ``MyDDPStrategy(...)`` builds an instance of its *flavour* for one
  namespace: ``type(name, (MyDDPStrategy, <that namespace's ParallelStrategy>))``, made once and cached.
  ``isinstance(x, MyDDPStrategy)`` holds for every flavour; user subclasses work the same way.
- the namespace of a new object is, in order: the class's own (``MyDDPStrategy.for_namespace(name)``), the
  namespace of a Lightning object among its arguments, then :func:`resolve`: the ``DDP_STRATEGY_LIGHTNING``
  environment variable; else the only namespace installed; else the only one the user has imported (we do
  not count the one we imported ourselves); else :data:`default`.
- where Lightning's base is an ABC (``Strategy``, ``CheckpointIO``), our class is also registered as a
  virtual subclass of the same base in every namespace loaded, so either ``Trainer`` accepts it; a
  strategy re-builds itself as the right flavour (its ``__init__`` run again with the same arguments)
  when a Trainer of the other namespace first connects it: ``strategy.accelerator = ...`` is the first
  thing both namespaces' ``_AcceleratorConnector`` sets, in 2.4, 2.5 and 2.6.
- namespace-neutral helpers (``rank_zero_info``, ``TrainerFn``, ``reset_seed``, ...) come from
  :data:`default`, the one namespace imported when ``ddp_strategy`` is: the one :func:`resolve` picks at
  that moment (``lightning`` when both are installed and neither is imported yet).

No namespace that is not installed is ever imported. Lightning's private names stay in
:mod:`ddp_strategy._compat.lightning_private`, which takes them from here.
"""

from __future__ import annotations

import abc
import copyreg
import inspect
import logging
from typing import Any, ClassVar

# The lower half (resolution, loading, neutral helpers), re-exported: callers use this module only.
from ddp_strategy._compat.resolve import (  # noqa: F401
    _LOADED,
    ENV_VAR,
    NAMESPACES,
    Namespace,
    RunningStage,
    TrainerFn,
    _check_name,
    default,
    get_filesystem,
    imported,
    installed,
    lightning_getattr,
    lightning_hasattr,
    load,
    on_load,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
    reset_seed,
    resolve,
    sync,
)

log = logging.getLogger(__name__)


def namespace_of(obj: Any) -> str | None:
    """The namespace ``obj`` (an object or a class) belongs to, from its class's modules; None if neither."""
    cls = obj if isinstance(obj, type) else type(obj)
    own = _own_namespace(cls)
    if own is not None:
        return own
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module.startswith(("lightning.pytorch", "lightning.fabric")):
            return "lightning"
        if module.startswith(("pytorch_lightning", "lightning_fabric")):
            return "pytorch_lightning"
    return None


# ----------------------------------------------------------------------------------- flavoured classes
def _own_namespace(cls: type) -> str | None:
    for klass in cls.__mro__:
        name = klass.__dict__.get("_ddp_namespace")
        if name is not None:
            return name
    return None


def _public_class(cls: type) -> type:
    for klass in cls.__mro__:
        if "_ddp_namespace" in klass.__dict__:
            return klass.__dict__["_ddp_public"]
    return cls


class _FlavouredMeta(abc.ABCMeta):
    """Metaclass of :class:`Flavoured`: class attributes Lightning's base defines (``load_from_checkpoint``,
    ``CHECKPOINT_HYPER_PARAMS_KEY``) are looked up on the flavour for :func:`resolve`'s namespace."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_") or _own_namespace(cls) is not None or not any(
                "_ddp_base" in klass.__dict__ for klass in cls.__mro__):
            raise AttributeError(f"type object {cls.__qualname__!r} has no attribute {name!r}")
        return getattr(cls.for_namespace(resolve()), name)  # type: ignore[attr-defined]


def _flavour_class(public: type, name: str) -> type:
    """Unpickling: the flavour of ``public`` for namespace ``name``."""
    return public.for_namespace(name)  # type: ignore[attr-defined]


def _reduce_class(cls: type) -> Any:
    # A flavour has the public class's name, so pickle cannot find it by name: rebuild it from the public
    # class (pickled by name) and the namespace. ``spawn`` and ``forkserver`` pickle the trainer this way.
    if "_ddp_namespace" in cls.__dict__:
        return _flavour_class, (cls.__dict__["_ddp_public"], cls.__dict__["_ddp_namespace"])
    return cls.__qualname__


copyreg.pickle(_FlavouredMeta, _reduce_class)

_FLAVOURS: dict[tuple[type, str], type] = {}
_BASES: list[type] = []


class Flavoured(metaclass=_FlavouredMeta):
    """A class of ours derived from a Lightning class named by path; instances are of a per-namespace flavour.

    Use :func:`lightning_base` rather than this class directly.
    """

    _ddp_base: ClassVar[str]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        flavour = cls if _own_namespace(cls) is not None else cls.for_namespace(
            _namespace_of_arguments(args, kwargs) or resolve())
        obj = super(Flavoured, flavour).__new__(flavour)  # noqa: UP008  (flavour, not cls)
        if isinstance(obj, _ConnectsToEitherTrainer):
            obj.__dict__["_ddp_init_args"] = (args, kwargs)
        return obj

    @classmethod
    def for_namespace(cls, name: str) -> type:
        """This class built on ``name``'s Lightning (``"lightning"`` or ``"pytorch_lightning"``), made once.

        ``MyDDPStrategy.for_namespace("pytorch_lightning")(...)`` chooses explicitly; the result is a subclass
        of both ``cls`` and that namespace's base class.

        Raises:
            ValueError, ModuleNotFoundError: ``name`` is not an installed namespace.
        """
        name = _check_name(name, "the namespace")
        own = _own_namespace(cls)
        if own is not None:
            if own == name:
                return cls
            if "_ddp_namespace" not in cls.__dict__:
                raise TypeError(f"{cls.__qualname__} subclasses the {own} flavour of a ddp_strategy class, so it"
                                f" cannot be built for {name}; subclass the public class instead.")
            cls = cls.__dict__["_ddp_public"]
        flavour = _FLAVOURS.get((cls, name))
        if flavour is None:
            namespace = load(name)
            base = namespace.get(cls._ddp_base)
            mixins = tuple(mixin for path, mixin in _MIXINS if issubclass(base, namespace.get(path)))
            flavour = _FlavouredMeta(cls.__name__, (cls, *mixins, base), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                "_ddp_namespace": name, "_ddp_public": cls})
            _FLAVOURS[(cls, name)] = flavour
        sync()
        return flavour


def lightning_base(path: str) -> type:
    """A base class standing for the Lightning class at ``path`` in whichever namespace the user runs.

    Args:
        path: see :meth:`Namespace.get`, e.g. ``"pytorch.strategies:ParallelStrategy"``.

    Returns:
        A :class:`Flavoured` subclass to derive from: ``class MyDDPStrategy(lightning_base(...))``.
    """
    base = _FlavouredMeta(f"LightningBase[{path}]", (Flavoured,), {"_ddp_base": path, "__module__": __name__})
    _BASES.append(base)
    for namespace in list(_LOADED.values()):
        _register_virtual(base, namespace)
    return base


def _register_virtual(base: type, namespace: Namespace) -> None:
    lightning_class = namespace.get(base._ddp_base)  # type: ignore[attr-defined]
    if isinstance(lightning_class, abc.ABCMeta):
        lightning_class.register(base)


on_load(lambda namespace: [_register_virtual(base, namespace) for base in _BASES])


def _namespace_of_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    found = {namespace_of(value) for value in (*args, *kwargs.values())} - {None}
    return found.pop() if len(found) == 1 else None


class _ConnectsToEitherTrainer:
    """Mixed into strategy flavours: follow the namespace of the Trainer that connects the strategy."""

    def _ddp_base_property(self) -> property:
        found = False
        for klass in type(self).__mro__:
            if found and "accelerator" in klass.__dict__:
                return klass.__dict__["accelerator"]
            found = found or klass is _ConnectsToEitherTrainer
        raise AssertionError("Lightning's Strategy defines the accelerator property")

    @property
    def accelerator(self) -> Any:
        return self._ddp_base_property().fget(self)  # type: ignore[misc]

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        theirs = namespace_of(accelerator)
        if theirs is not None and theirs != _own_namespace(type(self)):
            _reflavour(self, theirs)
        self._ddp_base_property().fset(self, accelerator)  # type: ignore[misc]


def _reflavour(obj: Any, name: str) -> None:
    """Turn ``obj`` into its class's flavour for ``name``, running ``__init__`` again with the same arguments."""
    args, kwargs = obj.__dict__.get("_ddp_init_args", ((), {}))
    target = _public_class(type(obj)).for_namespace(name)  # type: ignore[attr-defined]
    log.debug("re-building %s for %s, whose Trainer connects it", type(obj).__qualname__, name)
    obj.__dict__.clear()
    obj.__class__ = target
    obj.__dict__["_ddp_init_args"] = (args, kwargs)
    target.__init__(obj, *args, **kwargs)


#: Lightning's ``save_hyperparameters`` internals, registered by :mod:`ddp_strategy._compat.lightning_private`
#: when it is imported (it imports this module, so this module cannot import it).
_SAVE_HYPERPARAMETERS: list[Any] = []


def register_save_hyperparameters(function: Any) -> None:
    """Called once by :mod:`ddp_strategy._compat.lightning_private` with its ``save_hyperparameters``."""
    _SAVE_HYPERPARAMETERS[:] = [function]


class _SavesPublicInitArgs:
    """Mixed into LightningModule/LightningDataModule flavours: ``save_hyperparameters()`` collects the
    ``__init__`` arguments of our classes too (Lightning looks for frames of ``HyperparametersMixin``
    subclasses, and a method of the public class runs with ``__class__`` the public class)."""

    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        assert _SAVE_HYPERPARAMETERS, "ddp_strategy._compat.lightning_private registers it when imported"
        if frame is None:
            current = inspect.currentframe()
            frame = current.f_back if current is not None else None
        _SAVE_HYPERPARAMETERS[0](load(_own_namespace(type(self)) or resolve()), self, *args,
                                 ignore=ignore, frame=frame, logger=logger, classes=(Flavoured,))


#: (path of a Lightning class, mixin for flavours whose base derives from it), in MRO order.
_MIXINS: tuple[tuple[str, type], ...] = (
    ("pytorch.strategies:Strategy", _ConnectsToEitherTrainer),
    ("pytorch.core.mixins:HyperparametersMixin", _SavesPublicInitArgs),
)


class _AnyNamespaceMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return any(isinstance(obj, load(name).get(cls._ddp_path)) for name in imported() if name in installed())

    def __subclasscheck__(cls, sub: type) -> bool:
        return any(issubclass(sub, load(name).get(cls._ddp_path)) for name in imported() if name in installed())


def any_namespace(path: str) -> type:
    """A class for ``isinstance``/``except``-free checks: true for the class at ``path`` of any namespace loaded.

    Args:
        path: see :meth:`Namespace.get`.
    """
    return _AnyNamespaceMeta(path.rpartition(":")[2], (), {"_ddp_path": path, "__module__": __name__})


#: ``isinstance(e, SIGTERMException)`` holds for either namespace's exception.
SIGTERMException = any_namespace("pytorch.utilities.exceptions:SIGTERMException")
#: ``isinstance(m, LightningModule)`` holds for either namespace's module.
LightningModule = any_namespace("pytorch:LightningModule")
