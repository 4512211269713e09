"""Fixtures of the ledger's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event

from poold.ledger import db
from poold.ledger.db import Ledger


@pytest.fixture
def statements(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement poold sends, through SQLAlchemy or on the driver's cursor."""
    sent: list[str] = []
    on_cursor = db._on_cursor

    def counted(conn: Any, sql: str, bound: Any, *, many: bool = False) -> Any:
        sent.append(sql)
        return on_cursor(conn, sql, bound, many=many)

    def before(conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        sent.append(sql)

    monkeypatch.setattr(db, "_on_cursor", counted)
    event.listen(ledger.engine, "before_cursor_execute", before)
    yield sent
    event.remove(ledger.engine, "before_cursor_execute", before)
