"""The config reference (``docs/config_reference.md``), generated from the pydantic models themselves: every key of a
run config with its type, default and description, then each method's own parameters. A test compares the file
with what this module generates, so the reference cannot fall behind the code.

    python -m mcit.core.config_reference --write     (after changing a config model or a method's Params)
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

OUT = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"


def type_name(t: Any) -> str:
    """A field's annotation in words: ``int``, ``list[int]``, ``one of: adam, adamw, sgd``, ``str | None``."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:  # a validated type: the type itself
        return type_name(args[0])
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if t is type(None):
        return "None"
    return getattr(t, "__name__", str(t)).replace("typing.", "")


def default_of(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if value not in ("", None) else ("`None`" if value is None else "`''`")


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str = "") -> tuple[list[str], list[tuple[str, type[BaseModel]]]]:
    """One table row per field of ``model``; the nested models (sections, a task spec) to document after it."""
    out, nested = [], []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = [a for a in (f.annotation, *typing.get_args(f.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            nested.append((key, f.annotation))
            continue
        for sub in inner:  # list[str | TaskSpec]: the spec's keys under key[]
            nested.append((f"{key}[]", sub))
        for a in typing.get_args(f.annotation):
            for sub in typing.get_args(a):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    nested.append((f"{key}[]", sub))
        out.append(f"| `{key}` | {cell(type_name(f.annotation))} | {cell(default_of(f))} | "
                   f"{cell(f.description or '')} |")
    return out, nested


HEAD = "| key | type | default | description |\n|---|---|---|---|\n"


def section(title: str, model: type[BaseModel], prefix: str, doc: str = "") -> list[str]:
    body, nested = rows(model, prefix)
    parts = [f"## {title}\n\n" + (f"{cell(doc)}\n\n" if doc else "") + HEAD + "\n".join(body) + "\n"]
    for key, sub in nested:
        if sub.__name__ == "MethodConfig":
            continue
        parts += section(f"`{key}`", sub, f"{key}.", (sub.__doc__ or "").strip())
    return parts


def generate() -> str:
    """The whole reference: the run config's sections, then every registered method's parameters."""
    from mcit.core.config import RunConfig
    from mcit.core.registry import METHODS

    top, nested = rows(RunConfig)
    parts = ["# Config reference\n\nGenerated from the pydantic models by `python -m mcit.core.config_reference "
             "--write`; `tests/unit/test_config_reference.py` keeps it current. A config is YAML; every key below "
             "can also be given on the command line as `key.path=value` (parsed as YAML). Unknown keys are errors.\n",
             "## Top level\n\n" + HEAD + "\n".join(top) + "\n"]
    for key, sub in nested:
        if sub.__name__ == "MethodConfig":
            continue
        parts += section(f"`{key}`", sub, f"{key}.", (sub.__doc__ or "").strip())
    parts.append("## `method`\n\n`method.name` picks a method; its other keys are that method's parameters, "
                 "validated by its own model (below, one section per method).\n")
    for name in METHODS.names():
        cls = METHODS.get(name)
        if not cls.__module__.startswith("mcit.methods."):  # one a test or a user's module registered
            continue
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        body, _ = rows(cls.Params, "method.")
        parts.append(f"### `method.name: {name}`\n\n{cell(doc)}\n\n"
                     + (HEAD + "\n".join(body) + "\n" if body else "No parameters of its own.\n"))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {OUT} (default: print)")
    args = ap.parse_args(argv)
    text = generate()
    if args.write:
        from mcit.core.checkpoint import atomic_write_text

        atomic_write_text(OUT, text)
        print(f"wrote {OUT}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
