"""Small name -> factory registries.

Built-in entries live in modules that are imported lazily (on first lookup) so that importing
``mcit`` stays free of side effects while a new method or backbone still needs only one new file:
every module of a registry's package (``mcit/methods/*.py``, ``mcit/models/*.py``) is imported on
first lookup, and anything registered by a module the user (or a test) imports before the run counts
the same.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of classes; ``register`` is a decorator."""

    def __init__(self, kind: str, builtin_modules: tuple[str, ...] = (), package: str | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._builtin_modules = builtin_modules
        self._package = package
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            mods = list(self._builtin_modules)
            if self._package:
                pkg = importlib.import_module(self._package)
                mods += [f"{self._package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
            for mod in mods:
                importlib.import_module(mod)

    def get(self, name: str) -> T:
        self._load_builtins()
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._items)


METHODS: Registry = Registry("method", package="mcit.methods")
BACKBONES: Registry = Registry("backbone", package="mcit.models")
