"""Command-line flags derived from pydantic config fields, so that a default and its help text
are written once, on the field.

    add_field_flags(parser, SamplingParams, ["temperature", "top_p"])
    # --temperature FLOAT  0 = greedy; > 0 samples. (default: 0.0)
    # --top-p FLOAT        Nucleus mass in (0, 1]; 1 = off. (default: 1.0)

Every flag defaults to None, so a flag left out leaves the field to the model's own default (or
to a config file's value); `field_values` collects the flags that were given.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Iterable, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _argparse_type(annotation: Any) -> dict[str, Any]:
    """add_argument's type / choices / action for a field's annotation. Unions other than
    `X | None` are read as text and left to the model's validators (budget: N or 'chain')."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        return _argparse_type(members[0]) if len(members) == 1 else {"type": str}
    if origin is Literal:
        return {"choices": list(args)}
    if origin is list:
        return {"action": "append", **_argparse_type(args[0])}
    if annotation in (int, float, str):
        return {"type": annotation}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    raise TypeError(f"no command-line flag for a field of type {annotation!r}")


def add_field_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, model: type[BaseModel],
                    names: Iterable[str]) -> None:
    """Adds `--field-name` for each of `names`, fields of `model`: type or choices from the
    annotation (a list field is repeatable), help from the field's description and default."""
    for name in names:
        field = model.model_fields[name]
        if not field.description:
            raise ValueError(f"{model.__name__}.{name} has no description for its --help")
        kind = _argparse_type(field.annotation)
        help_text = field.description
        if kind.get("action") == "append":
            help_text += " (repeatable)"
        elif field.default not in (None, PydanticUndefined):
            help_text += f" (default: {field.default})"
        parser.add_argument(flag_name(name), dest=name, default=None, help=help_text.replace("%", "%%"), **kind)


def field_values(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The given flags among `names`, as {field: value}, for the model to validate."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
