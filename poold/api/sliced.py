"""A large request body validated a slice at a time: how poold parses a heartbeat of
100,000 renewals without stopping every other request while it does.

pydantic validates a whole body in one call that holds the GIL: ~0.1 s for 100,000
renewals here (~0.3 s when the garbage collector runs meanwhile), and the event loop,
`/v1/health` and every other worker thread wait that long. A body of at least
`SLICED_BODY_BYTES` is parsed by pydantic-core's own JSON parser alone (jiter, object keys
cached: ~30 ms for 6 MB of renewals where `json.loads` took ~60, both one call holding the
GIL) and validated in Python mode, as FastAPI validates a body it parsed itself; each
of its long lists `SLICE` items at a time, the GIL let go between slices. The result is
the same model, and an invalid body gets the errors one call would give, locations
included.
"""

from __future__ import annotations

import functools
import json
import time
import types
import typing
from typing import Annotated, Any, TypeVar

import pydantic_core
from pydantic import BaseModel, TypeAdapter, ValidationError

M = TypeVar("M", bound=BaseModel)

SLICED_BODY_BYTES = 1 << 20
SLICE = 2_000


class BodyInvalid(ValueError):
    """The body does not validate: pydantic's error dicts (`ValidationError.errors()`)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


def _list_type(model: type[BaseModel], name: str) -> Any:
    """The field's list type when it is list[X] or list[X] | None; None otherwise (a union
    of lists, not a list: validated in one call)."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    annotation = field.annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    lists = [a for a in args if typing.get_origin(a) is list]
    if len(lists) != 1 or any(a is not types.NoneType and a not in lists for a in args):
        return None
    return lists[0]


def _sliceable(model: type[BaseModel], name: str) -> bool:
    return _list_type(model, name) is not None


@functools.cache
def _list_items(model: type[BaseModel], name: str) -> tuple[TypeAdapter[Any], TypeAdapter[Any]]:
    """For a list field: an adapter for its length rules alone, and one for its items."""
    field = model.model_fields[name]
    (item,) = typing.get_args(_list_type(model, name))
    rules: Any = list[Any]
    if field.metadata:  # Field(max_length=...): the length rules, checked on the whole list
        rules = Annotated.__class_getitem__((list[Any], *field.metadata))  # type: ignore[attr-defined]
    return TypeAdapter(rules), TypeAdapter(list[item])  # type: ignore[valid-type]


def _errors(exc: ValidationError, prefix: tuple[Any, ...] = (), offset: int = 0) -> list[Any]:
    out = []
    for e in exc.errors(include_url=False):
        loc = tuple(e["loc"])
        if offset and loc and isinstance(loc[0], int):
            loc = (loc[0] + offset, *loc[1:])
        out.append({**e, "loc": (*prefix, *loc)})
    return out


def _customised(model: type[BaseModel]) -> bool:
    """Validators or serializers of the model's own: a slice of it would skip them."""
    d = model.__pydantic_decorators__
    return bool(
        d.model_validators or d.field_validators or d.model_serializers or d.field_serializers
    )


def _in_json_mode(exc: ValidationError, adapter: TypeAdapter[Any], value: Any) -> ValidationError:
    """The errors of a refused value as JSON mode words them (its messages differ a little
    from Python mode's: "Input should be an object"), as one call on the body gives them."""
    try:
        adapter.validate_json(json.dumps(value))
    except ValidationError as again:
        return again
    return exc


def validate_json(model: type[M], raw: bytes) -> M:
    """`model.model_validate_json(raw)`, in slices when `raw` is large; `BodyInvalid`."""
    try:
        if len(raw) < SLICED_BODY_BYTES or _customised(model):
            return model.model_validate_json(raw)
        try:
            # NaN and Infinity are not JSON: pydantic refuses them, so does this parse.
            data = pydantic_core.from_json(raw, allow_inf_nan=False, cache_strings="keys")
        except ValueError:
            return model.model_validate_json(raw)  # pydantic's own words for bad JSON
        if not isinstance(data, dict):
            return model.model_validate_json(raw)  # refused: in pydantic's own words
        long = [
            name
            for name, value in data.items()
            if isinstance(value, list) and len(value) > SLICE and _sliceable(model, name)
        ]
        if not long:
            return model.model_validate_json(raw)  # large, but no list to slice
        # Everything but the long lists, and their first items, in one call.
        head = {**data, **{name: data[name][:1] for name in long}}
        try:
            parsed = model.model_validate(head)
        except ValidationError as exc:
            raise BodyInvalid(_errors(_in_json_mode(exc, TypeAdapter(model), head))) from None
    except ValidationError as exc:
        raise BodyInvalid(_errors(exc)) from None
    for name in long:
        length, items = _list_items(model, name)
        values: list[Any] = data[name]
        try:
            length.validate_python(values)
        except ValidationError as exc:
            raise BodyInvalid(_errors(exc, (name,))) from None
        out: list[Any] = []
        for start in range(0, len(values), SLICE):
            time.sleep(0)  # the GIL to whoever waits for it: the event loop, other requests
            part = values[start : start + SLICE]
            try:
                out.extend(items.validate_python(part))
            except ValidationError as exc:
                exc = _in_json_mode(exc, items, part)
                raise BodyInvalid(_errors(exc, (name,), start)) from None
        setattr(parsed, name, out)
    return parsed


def _placeholder(name: str) -> str:
    # NUL cannot stand unescaped in a JSON string: no rendered value can equal this.
    return f"\0sliced:{name}\0"


def dump_json(adapter: TypeAdapter[Any], value: Any) -> bytes:
    """`adapter.dump_json(value)`, its long lists rendered `SLICE` items at a time when
    `value` is a model that has them (a heartbeat's reply of 100,000 renewals: ~50 ms in
    one call), the GIL let go between slices."""
    if not isinstance(value, BaseModel) or _customised(type(value)):
        return adapter.dump_json(value)
    model = type(value)
    long = [
        name
        for name in model.model_fields
        if isinstance(getattr(value, name), list)
        and len(getattr(value, name)) > SLICE
        and _sliceable(model, name)
    ]
    if not long:
        return adapter.dump_json(value)
    head = value.model_copy(update={name: [] for name in long})
    rendered: dict[str, Any] = adapter.dump_python(head, mode="json")
    lists: dict[str, bytes] = {}
    for name in long:
        _length, items = _list_items(model, name)
        values = getattr(value, name)
        parts = []
        for start in range(0, len(values), SLICE):
            time.sleep(0)
            parts.append(items.dump_json(values[start : start + SLICE])[1:-1])
        lists[name] = b"[" + b",".join(parts) + b"]"
        rendered[name] = _placeholder(name)
    out = json.dumps(rendered, separators=(",", ":")).encode()
    for name, body in lists.items():
        out = out.replace(json.dumps(_placeholder(name)).encode(), body, 1)
    return out
