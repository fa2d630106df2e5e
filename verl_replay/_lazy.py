"""Lazy public names for packages: resolved from their modules on first access, then cached."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``; ``exports`` maps a public name to its module.

    A module name starting with ``.`` is relative to ``package``. Importing the package itself
    then imports none of those modules (keeps ``import verl_replay`` free of torch, verl, ray).
    """

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if module_name.startswith("."):
            module_name = package + module_name
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace.get("__all__", exports)))

    return __getattr__, __dir__
