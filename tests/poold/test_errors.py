"""poold/errors.py: is every stable code unique, well-formed, and rebuilt from the wire?"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from poold import errors
from poold.errors import (
    DuplicateErrorCode,
    NotFound,
    PoolError,
    UnknownLease,
    all_codes,
    from_wire,
)


def defined_here() -> list[type[PoolError]]:
    """PoolError and every subclass poold/errors.py defines (not the ones tests define)."""
    return [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type)
        and issubclass(obj, PoolError)
        and obj.__module__ == errors.__name__
    ]


def test_the_module_defines_the_classes_it_is_known_for() -> None:
    names = {cls.__name__ for cls in defined_here()}
    assert {"PoolError", "BadRequest", "UnknownLease", "NoCapacity", "AgentBusy"} <= names


def test_every_code_belongs_to_one_class() -> None:
    by_code: dict[str, list[str]] = defaultdict(list)
    for cls in defined_here():
        by_code[cls.code].append(cls.__name__)
    shared = {code: names for code, names in by_code.items() if len(names) > 1}
    assert not shared, f"codes shared by several classes: {shared}"


def test_every_class_names_its_own_code() -> None:
    """A subclass that inherited its parent's code would come back from the wire as the parent."""
    inheriting = [cls.__name__ for cls in defined_here() if "code" not in vars(cls)]
    assert not inheriting


def test_every_code_is_a_lowercase_identifier() -> None:
    bad = [
        (cls.__name__, cls.code)
        for cls in defined_here()
        if not re.fullmatch(r"[a-z][a-z0-9_]*", cls.code)
    ]
    assert not bad


def test_all_codes_maps_every_code_to_its_class() -> None:
    codes = all_codes()
    for cls in defined_here():
        assert codes[cls.code] is cls


@pytest.mark.parametrize("cls", defined_here(), ids=lambda cls: cls.code)
def test_from_wire_rebuilds_the_class(cls: type[PoolError]) -> None:
    err = from_wire(cls.code, "what the server said", {"name": "x"})
    assert type(err) is cls
    assert err.code == cls.code and err.message == "what the server said"
    assert err.detail == {"name": "x"}
    assert err.to_dict() == {
        "code": cls.code,
        "message": "what the server said",
        "detail": {"name": "x"},
    }


def test_from_wire_keeps_an_unknown_code() -> None:
    err = from_wire("from_a_newer_server", "new")
    assert type(err) is PoolError and err.code == "from_a_newer_server"


def test_a_class_claiming_a_taken_code_is_refused() -> None:
    with pytest.raises(
        DuplicateErrorCode, match=re.escape("'unknown_lease', already poold.errors.UnknownLease's")
    ):

        class ShadowLease(NotFound):
            code = "unknown_lease"

    assert all_codes()["unknown_lease"] is UnknownLease


def test_a_class_claiming_the_base_code_is_refused() -> None:
    with pytest.raises(DuplicateErrorCode, match="'internal'"):

        class AnotherInternal(PoolError):
            code = "internal"

    assert all_codes()["internal"] is PoolError


def test_a_class_inheriting_its_parents_code_is_refused() -> None:
    with pytest.raises(DuplicateErrorCode, match="inherits code 'not_found'"):

        class QuietNotFound(NotFound):
            pass

    assert all_codes()["not_found"] is NotFound
