"""A model whose fields are another's, each optional: a section of one config that passes
part of another program's settings through (the host config's [proxy]: ProxySettings'
keys), each value checked by the very field it is for, so the setting stays declared once.

A field left out is None and absent from `model_dump(exclude_none=True)`: the program
then takes its own default. The settings model's own cross-field checks are not run here
(they need the whole settings); the program runs them when it reads its file."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, create_model

_Base = TypeVar("_Base", bound=BaseModel)


def optional_fields(model: type[BaseModel], name: str, base: type[_Base],
                    module: str, doc: str) -> type[_Base]:
    """A subclass of `base` named `name` (defined in `module`) with each of `model`'s
    fields, its type made optional, its constraints and description kept, default None."""
    fields: dict[str, Any] = {
        key: (Annotated[(field.annotation | None, *field.metadata)],
              Field(None, description=field.description))
        for key, field in model.model_fields.items()}
    return create_model(name, __base__=base, __module__=module, __doc__=doc, **fields)
