"""Module paths of the flat layout (``ddp_strategy`` 0.1) that moved into sub-packages.

Each old path (``ddp_strategy.comm_hooks``, ``ddp_strategy.model``, ...) is a small module that finds every
name the old module had in the modules its code now lives in, so old imports, ``import ddp_strategy.sampler``
followed by ``ddp_strategy.sampler.X``, configs and pickles that name an old path keep working. Nothing is
imported until a name is looked up.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class MovedModule(types.ModuleType):
    """An old module path: attribute lookups go to ``homes`` in order (``renamed`` maps old names to new ones)."""

    def __init__(self, name: str, homes: tuple[str, ...], renamed: dict[str, str] | None = None) -> None:
        super().__init__(name, f"Moved: the code of {name} now lives in {', '.join(homes)}.")
        self.__homes = homes
        self.__renamed = dict(renamed or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        new_name = self.__renamed.get(name, name)
        for home in self.__homes:
            module = importlib.import_module(home)
            if hasattr(module, new_name):
                return getattr(module, new_name)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(self.__homes)}) has no attribute"
                             f" {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({name for home in self.__homes for name in dir(importlib.import_module(home))})


def install(package: str, moves: dict[str, tuple[str, ...]], renamed: dict[str, dict[str, str]]) -> None:
    """Make each ``package.<old>`` of ``moves`` importable and an attribute of ``package`` (homes are relative)."""
    parent = sys.modules[package]
    for old, homes in moves.items():
        name = f"{package}.{old}"
        module = sys.modules.setdefault(name, MovedModule(name, tuple(f"{package}.{h}" for h in homes),
                                                          renamed.get(old)))
        setattr(parent, old, module)
