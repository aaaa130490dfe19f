"""Command-line flags walked from a pydantic settings model, as vLLM builds its engine flags
from one dataclass: a field's description is its help and its Flag (in the field's
`Annotated` metadata) its group and spelling, so a setting is declared once.

Every flag defaults to None (not given), so that what a config file or the environment set
stays unless the flag says otherwise; `given` collects only what was said."""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Flag:
    """How one settings field is given on the command line."""

    group: str  # the --help section it is listed under
    # Default: the field's name with `-` for `_`, a trailing `_s` dropped (seconds are the
    # unit of every `_s` field). On a field holding a model: the prefix of its fields' flags.
    name: str | None = None
    metavar: str | None = None  # default: SECONDS for an `_s` field, else argparse's
    # Turns one value (a list's: each) into what the field holds, e.g. a node's URL into
    # its table. Default: the field's own type.
    parse: Callable[[str], Any] | None = None
    # Also read from this environment variable (a list's items comma-separated); a flag
    # given wins over it.
    env: str | None = None


@dataclass(frozen=True)
class Option:
    """One flag as walked from the model: where its value goes."""

    path: tuple[str, ...]  # field names from the top model down
    flag: Flag
    option: str  # e.g. --k8s-namespace
    field: FieldInfo
    kind: Any  # the field's type, None stripped

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    @property
    def is_list(self) -> bool:
        return get_origin(self.kind) is list


def _declared(field: FieldInfo, where: str) -> Flag:
    flags = [m for m in field.metadata if isinstance(m, Flag)]
    if len(flags) != 1:
        raise TypeError(f"{where} needs one Flag in its Annotated metadata, has {len(flags)}")
    return flags[0]


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def options(model: type[BaseModel], prefix: str = "",
            path: tuple[str, ...] = ()) -> Iterator[Option]:
    """Each flag of the model's fields, a field holding a model walked into (its fields'
    flags named after it); raises TypeError for a field without its Flag."""
    for name, field in model.model_fields.items():
        flag = _declared(field, f"{model.__name__}.{name}")
        kind = _without_none(field.annotation)
        spelled = flag.name or name.removesuffix("_s").replace("_", "-")
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from options(kind, f"{prefix}{spelled}-", (*path, name))
        else:
            yield Option((*path, name), flag, f"--{prefix}{spelled}", field, kind)


def _default(o: Option) -> str | None:
    value = o.field.default
    if value is None or value is PydanticUndefined or o.is_list:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _help(o: Option) -> str:
    notes = ["repeatable"] if o.is_list else []
    if o.flag.env:
        notes.append(f"also ${o.flag.env}" + (", comma-separated" if o.is_list else ""))
    default = _default(o)
    if default is not None:
        notes.append(f"default: {default}")
    text = (o.field.description or "") + (f" ({'; '.join(notes)})" if notes else "")
    return text.replace("%", "%%")  # argparse formats help with %


def _argument(o: Option) -> dict[str, Any]:
    kw: dict[str, Any] = {"dest": o.dest, "help": _help(o)}
    metavar = o.flag.metavar or ("SECONDS" if o.path[-1].endswith("_s") else None)
    kind = get_args(o.kind)[0] if o.is_list else o.kind
    if kind is bool:
        return {**kw, "action": argparse.BooleanOptionalAction}
    if get_origin(kind) is Literal:
        return {**kw, "choices": list(get_args(kind))}
    if metavar:
        kw["metavar"] = metavar
    if o.is_list:
        kw["action"] = "append"
    parse = o.flag.parse or (kind if kind in (int, float) else None)
    return {**kw, "type": parse} if parse else kw


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Adds the model's flags to the parser, each group an argument group in the order the
    fields first name it."""
    groups: dict[str, Any] = {}
    for o in options(model):
        if o.flag.group not in groups:
            groups[o.flag.group] = parser.add_argument_group(o.flag.group)
        groups[o.flag.group].add_argument(o.option, **_argument(o))


def _from_env(o: Option, raw: str) -> Any:
    parse = o.flag.parse or (lambda v: v)
    if o.is_list:
        items = [parse(v.strip()) for v in raw.split(",") if v.strip()]
        return items or None
    return parse(raw.strip()) if raw.strip() else None


def given(model: type[BaseModel], args: Mapping[str, Any], environ: Mapping[str, str],
          data: dict[str, Any]) -> dict[str, Any]:
    """Sets in `data` (e.g. a config file's) what the environment and then the model's
    flags (`vars()` of the parsed arguments) say, a nested model's table merged into;
    returns it."""
    for o in options(model):
        value = args.get(o.dest)
        if value is None and o.flag.env:
            value = _from_env(o, environ.get(o.flag.env, ""))
        if value is not None:
            _set_path(data, o.path, value)
    return data


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """data[path[0]][path[1]]... = value, the tables on the way made or kept."""
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value
