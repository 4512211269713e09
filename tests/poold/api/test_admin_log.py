"""Every administrative change leaves one INFO line (logger poold.admin); reads leave none."""

from __future__ import annotations

import logging

import pytest

from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec, TenantUpdate


def admin_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "poold.admin"]


def test_one_info_line_per_admin_change(
    admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="poold.admin")
    admin.create_tenant(TenantSpec(name="llm-a", quota_bytes=64 << 30))
    admin.update_tenant("llm-a", TenantUpdate(quota_bytes=32 << 30))
    admin.list_tenants()
    admin.get_tenant("llm-a")
    host = admin.add_host("h1")
    admin.delete_tenant("llm-a")
    lines = admin_lines(caplog)
    assert len(lines) == 4, lines
    assert lines[0].startswith("admin: create_tenant ") and '"name":"llm-a"' in lines[0]
    assert lines[1] == f'admin: update_tenant name=llm-a {{"quota_bytes":{32 << 30}}}'
    assert lines[2].startswith("admin: add_host ") and host.credential not in lines[2]
    assert lines[3] == "admin: delete_tenant name=llm-a"
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "poold.admin")


def test_a_refused_change_logs_no_change_line(
    admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="poold.admin")
    with pytest.raises(Exception, match="llm-z"):
        admin.delete_tenant("llm-z")
    assert admin_lines(caplog) == []
