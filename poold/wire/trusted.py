"""How is a wire model built from values that are already checked, on a hot path?

``model_construct`` skips validation but still walks every field for aliases and
defaults: 8 us for a :class:`poold.wire.common.LeaseOut`, four such models per local
lease+release in the agent. :func:`trusted` takes every field at once and sets the
instance's state as ``model_construct`` would (pydantic 2: ``__dict__``, the fields set,
no extra, no private attributes), in under 2 us. It refuses a model it cannot build
that way (aliases, defaults to fill, extra allowed, private attributes, a post-init
hook) and a call that does not name exactly the model's fields: both are mistakes of the
caller, found by the first test that builds one.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

_M = TypeVar("_M", bound=BaseModel)

_setattr = object.__setattr__
_fields: dict[type[BaseModel], frozenset[str]] = {}


def _names(cls: type[BaseModel]) -> frozenset[str]:
    names = _fields.get(cls)
    if names is None:
        aliased = any(
            f.alias is not None or f.validation_alias is not None for f in cls.model_fields.values()
        )
        if (
            aliased
            or cls.model_config.get("extra") == "allow"
            or cls.__private_attributes__
            or cls.__pydantic_post_init__
            or cls.__pydantic_root_model__
        ):
            raise TypeError(f"{cls.__name__} cannot be built by trusted(); use model_construct")
        names = _fields[cls] = frozenset(cls.model_fields)
    return names


def trusted(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance of ``cls`` holding ``values`` (every field, checked by the caller),
    equal to ``cls.model_construct(**values)``; ``values`` becomes its ``__dict__``."""
    names = _names(cls)
    if values.keys() != names:
        missing = sorted(names - values.keys())
        extra = sorted(values.keys() - names)
        raise TypeError(f"trusted {cls.__name__}: missing {missing}, unknown {extra}")
    model = cls.__new__(cls)
    _setattr(model, "__dict__", values)
    _setattr(model, "__pydantic_fields_set__", set(names))
    _setattr(model, "__pydantic_extra__", None)
    _setattr(model, "__pydantic_private__", None)
    return model
