"""Do the ledger's column types bind and read back the same values on either backend?"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy.dialects import sqlite
from sqlalchemy.types import TypeDecorator

from poold.ledger.types import UTCDateTime

EAST = timezone(timedelta(hours=2))


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=EAST),
        datetime(2026, 1, 2, 1, 4, 5, tzinfo=UTC),  # no microseconds: still written
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(999, 12, 31, 23, 59, 59, 1, tzinfo=timezone(timedelta(0))),
        datetime(2026, 12, 31, 23, 30, tzinfo=timezone(timedelta(hours=-1))),  # next year
        datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=ZoneInfo("Europe/Berlin")),  # DST ends
    ],
)
def test_a_datetime_binds_on_sqlite_as_sqlalchemys_own_datetime(value: datetime) -> None:
    """One step, the same text as SQLAlchemy's own TypeDecorator path (the decorator's
    conversion to naive UTC, then SQLite's DATETIME): the ledger's stored times and their
    order (compared as text) stay as they were."""
    dialect = sqlite.dialect()
    typ = UTCDateTime().dialect_impl(dialect)
    ours = typ.bind_processor(dialect)
    theirs = TypeDecorator.bind_processor(typ, dialect)  # what the class did before
    assert ours is not None and theirs is not None
    assert ours(value) == theirs(value)
    assert ours(None) is None


def test_a_naive_datetime_is_refused_on_sqlite() -> None:
    dialect = sqlite.dialect()
    ours = UTCDateTime().dialect_impl(dialect).bind_processor(dialect)
    assert ours is not None
    with pytest.raises(ValueError, match="naive"):
        ours(datetime(2026, 1, 1))
