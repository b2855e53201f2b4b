"""Write docs/api.md, the API reference, from the public objects' signatures and docstrings.

    python docs/api_reference.py            # rewrites docs/api.md
    python docs/api_reference.py --check    # exit 1 when docs/api.md is not what the code says

The reference covers what a user imports: `sparseserve_hf.__all__`, the helpers the README's
snippets use, and the server's entry points. A class lists its own public methods and properties
(not those inherited from transformers, which differ between its versions). The test suite runs
`--check`, so a docstring and its reference cannot drift apart.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

OUT = Path(__file__).resolve().parent / "api.md"

# (section title, dotted module, names): the order the reference is read in.
SECTIONS = (
    ("The drop-in", "sparseserve_hf", ("SparseServeConfig", "SparseServeCache", "register")),
    ("Batching", "sparseserve_hf", ("Generator", "SamplingParams", "RequestOutput", "StreamEvent", "GeneratorGroup")),
    ("Helpers", "sparseserve_hf.compat", ("cache_kwarg",)),
    (
        "The real models",
        "sparseserve_hf.data.models",
        ("load_model", "prepare_model", "load_default", "prepare_default_model"),
    ),
    ("The server in an application of your own", "sparseserve_hf.serve.app", ("ServerSettings", "create_app")),
)
HEADER = """# API reference

Generated from the docstrings by `python docs/api_reference.py` (the test suite checks that it is
current). Importing `sparseserve_hf` registers `attn_implementation="sparseserve"`; the server needs
`pip install -e ".[serve]"`.
"""


def render() -> str:
    """The whole reference as Markdown."""
    parts = [HEADER]
    for title, module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        parts.append(f"## {title}\n")
        for name in names:
            parts.extend(_object(module_name, name, getattr(module, name)))
    parts.extend(_serve_command())
    return "\n".join(parts).rstrip() + "\n"


def _serve_command() -> Iterator[str]:
    """`sparseserve-hf serve`'s options as a table, read from its parser (not its help text, whose
    layout differs between Python versions)."""
    from sparseserve_hf.serve import cli

    parser = argparse.ArgumentParser(prog="sparseserve-hf serve")
    cli.add_serve_arguments(parser)
    yield "## The server command\n"
    yield "`sparseserve-hf serve [MODEL_FOLDER] [options]` (or `python -m sparseserve_hf.serve`, `make serve`).\n"
    yield "| option | default | meaning |\n|---|---|---|"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(action.option_strings) or action.dest.upper()
        default = "" if action.default is None else f"`{action.default}`"
        yield f"| `{name}` | {default} | {action.help or ''} |"
    yield ""


def _object(module_name: str, name: str, obj: object) -> Iterator[str]:
    """A class (its signature, docstring and members) or a function."""
    yield f"### `{module_name}.{name}`\n"
    if not inspect.isclass(obj):
        yield _code(f"def {name}{_signature(obj)}")
        yield _doc(obj)
        return
    yield _code(f"class {name}{_signature(obj)}")
    yield _doc(obj)
    yield from _members(name, obj)


def _members(class_name: str, cls: type) -> Iterator[str]:
    """The public methods and properties `cls` and its bases in this package define, the class's
    own first, each in source order (a dataclass's fields are in its signature)."""
    seen = set(getattr(cls, "__dataclass_fields__", {}))
    for owner in cls.__mro__:
        if not owner.__module__.startswith("sparseserve_hf"):
            continue
        for name, member in vars(owner).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            yield from _member(class_name, name, member)


def _member(class_name: str, name: str, member: object) -> Iterator[str]:
    if isinstance(member, property):
        yield f"#### `{class_name}.{name}` (property)\n"
        yield _doc(member.fget)
    elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
        function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        yield f"#### `{class_name}.{name}`\n"
        yield _code(f"def {name}{_signature(function, drop_self=not isinstance(member, staticmethod))}")
        yield _doc(function)


class _Written:
    """An annotation shown as written in the source (a postponed annotation is a string)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: object, drop_self: bool = False) -> str:
    """`(a: int = 1, ...) -> T`, annotations as written; one parameter per line when long."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parameters = [
        p.replace(annotation=_Written(p.annotation)) if isinstance(p.annotation, str) else p
        for p in signature.parameters.values()
    ]
    if drop_self and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    returns = signature.return_annotation
    if inspect.isclass(obj):
        returns = inspect.Signature.empty
    elif isinstance(returns, str):
        returns = _Written(returns)
    text = str(signature.replace(parameters=parameters, return_annotation=returns))
    if len(text) <= 100:
        return text
    lines = [str(p) for p in parameters]
    if any(p.kind is p.KEYWORD_ONLY for p in parameters) and not any(p.kind is p.VAR_POSITIONAL for p in parameters):
        first_keyword = next(i for i, p in enumerate(parameters) if p.kind is p.KEYWORD_ONLY)
        lines.insert(first_keyword, "*")
    tail = ")" if returns is inspect.Signature.empty else f") -> {returns!r}"
    return "(\n" + "".join(f"    {line},\n" for line in lines) + tail


def _doc(obj: object) -> str:
    """The docstring, dedented, or a note that there is none."""
    doc = inspect.getdoc(obj)
    return (doc if doc else "(no docstring)") + "\n"


def _code(text: str) -> str:
    return f"```python\n{text}\n```\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with docs/api.md instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUT.exists() and OUT.read_text() == text:
            return 0
        print(f"{OUT} is out of date: run python docs/api_reference.py", file=sys.stderr)
        return 1
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
