"""Every public class, function and method defined in `sparseserve_hf` has a docstring.

Public: a module-level class or function whose name does not start with `_`, in a module whose
dotted path has no `_`-prefixed part, and the `_`-free methods and properties such a class defines
itself. Kernel modules that cannot import here (flash-attn adapters without flash-attn) are read
with `ast` instead, so they are checked too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import sparseserve_hf

# The only modules allowed to fail to import on a CPU box (all but kernel files import everywhere).
KERNEL_MODULE = re.compile(r"^sparseserve_hf\.ops\.(flash|triton)_\w+$")


def is_public(dotted: str) -> bool:
    """No part of the dotted name starts with an underscore."""
    return not any(part.startswith("_") for part in dotted.split("."))


def has_own_docstring(obj: object) -> bool:
    """True when `obj` carries a docstring someone wrote, not one Python generated."""
    if not inspect.isclass(obj):
        return bool((obj.__doc__ or "").strip())
    doc = obj.__dict__.get("__doc__")  # its own, not one inherited from a base class
    # @dataclass and NamedTuple fill a missing class docstring with "Name(field, ...)".
    if doc and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc.strip(), flags=re.DOTALL):
        return False
    return bool(doc and doc.strip())


def method_functions(cls: type) -> dict[str, object]:
    """The public methods and properties `cls` defines itself, unwrapped to their functions."""
    found = {}
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attr, property):
            found[name] = attr.fget
        elif isinstance(attr, (staticmethod, classmethod)):
            found[name] = attr.__func__
        elif inspect.isfunction(attr):
            found[name] = attr
    return found


def undocumented_in(module: ModuleType) -> list[str]:
    """Dotted names of the public objects `module` defines that lack a docstring."""
    missing = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if obj.__module__ != module.__name__:  # imported from elsewhere: checked where it is defined
            continue
        if not has_own_docstring(obj):
            missing.append(f"{module.__name__}.{name}")
        if inspect.isclass(obj):
            for method, func in method_functions(obj).items():
                if not (func.__doc__ or "").strip():
                    missing.append(f"{module.__name__}.{name}.{method}")
    return missing


def undocumented_in_source(module_name: str, path: Path) -> list[str]:
    """`undocumented_in` for a module that cannot import here, read from its source."""
    missing = []
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, definitions) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node) is None:
            missing.append(f"{module_name}.{node.name}")
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                is_method = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if is_method and not child.name.startswith("_") and ast.get_docstring(child) is None:
                    missing.append(f"{module_name}.{node.name}.{child.name}")
    return missing


def public_module_names() -> list[str]:
    """Every public module and subpackage of sparseserve_hf, the package itself first."""
    walked = pkgutil.walk_packages(sparseserve_hf.__path__, prefix="sparseserve_hf.")
    return ["sparseserve_hf"] + sorted(info.name for info in walked if is_public(info.name))


@pytest.mark.core
def test_every_public_class_function_and_method_has_a_docstring():
    missing = []
    for name in public_module_names():
        try:
            module = importlib.import_module(name)
        except ImportError:
            if not KERNEL_MODULE.match(name):
                raise  # only kernel files may need a GPU library to import
            missing += undocumented_in_source(name, Path(importlib.util.find_spec(name).origin))
            continue
        missing += undocumented_in(module)
    assert not missing, f"{len(missing)} public objects without a docstring:\n  " + "\n  ".join(missing)


@pytest.mark.core
def test_the_check_sees_a_missing_docstring():
    module = ModuleType("fake_module")

    class Documented:
        """Has one."""

        def method(self) -> None:
            pass

    @dataclass
    class Plain:  # @dataclass writes "Plain(x: int)" into __doc__: not a docstring
        x: int

    def bare() -> None:
        pass

    for obj in (Documented, Plain, bare):
        obj.__module__ = "fake_module"
        setattr(module, obj.__name__, obj)
    assert undocumented_in(module) == ["fake_module.Documented.method", "fake_module.Plain", "fake_module.bare"]
