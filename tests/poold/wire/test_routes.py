"""The route table is the one place a route is written: the server binds a handler to
each route, and the client has a method per route that sends exactly that route."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from poold.api import app as app_module
from poold.api.client import PooldClient
from poold.errors import PoolError
from poold.ledger.db import Ledger
from poold.wire import routes
from poold.wire.routes import ROUTES, Route


@pytest.fixture
def app(ledger: Ledger) -> FastAPI:
    return app_module.create_app(ledger, "token")


def test_every_route_has_one_handler_with_its_method_and_path(app: FastAPI) -> None:
    served = {r.name: r for r in app.routes if isinstance(r, APIRoute)}
    assert set(served) == set(ROUTES)
    for name, route in ROUTES.items():
        assert served[name].path == route.path
        assert served[name].methods == {route.method}
        assert served[name].status_code == route.status_code


def test_routes_are_served_in_table_order(app: FastAPI) -> None:
    """Overlapping paths ({uid:path} before .../drain) depend on the table's order."""
    served = [r.name for r in app.routes if isinstance(r, APIRoute)]
    assert served == list(ROUTES)


def test_a_route_without_a_handler_refuses_to_start(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra: Route[None] = Route("GET", "/v1/nothing", None, "admin", name="nothing_here")
    monkeypatch.setitem(ROUTES, "nothing_here", extra)
    with pytest.raises(RuntimeError, match="routes without a handler: nothing_here"):
        app_module.create_app(ledger, "token")


def test_a_handler_whose_body_differs_from_its_route_refuses_to_start(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = Route("POST", "/v1/leases", routes.grant.response, "agent", body=None, name="grant")
    monkeypatch.setitem(ROUTES, "grant", wrong)
    with pytest.raises(RuntimeError, match="handler grant takes"):
        app_module.create_app(ledger, "token")


class _Sent(Exception):
    """Raised instead of sending: carries the route the client method used."""

    def __init__(self, route: Route[Any], path: dict[str, str]) -> None:
        super().__init__(route.name)
        self.route = route
        self.path = path


@pytest.mark.parametrize("name", list(ROUTES))
def test_every_route_has_a_client_method_that_sends_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    method = getattr(PooldClient, name, None)
    assert method is not None, f"PooldClient has no method for route {name}"
    client = PooldClient("http://127.0.0.1:9", "token")

    def capture(route: Route[Any], *_a: Any, **kw: Any) -> Any:
        raise _Sent(route, {k: v for k, v in kw.items() if k in route.path_params})

    monkeypatch.setattr(client, "_send", capture)
    required = [
        p
        for p in inspect.signature(method).parameters.values()
        if p.name != "self" and p.default is inspect.Parameter.empty
    ]
    args = [_args_for(name, p) for p in required]
    with pytest.raises(_Sent) as sent:
        getattr(client, name)(*args)
    assert sent.value.route is ROUTES[name]
    assert set(sent.value.path) == set(ROUTES[name].path_params)
    client.close()


def _args_for(route_name: str, param: inspect.Parameter) -> Any:
    """A value of the right model for a client method's required argument."""
    body = ROUTES[route_name].body
    hint = str(param.annotation)
    if body is not None and body.__name__ in hint:
        return body.model_construct()
    if "list[LeaseOp]" in hint:
        return []
    if "list[str]" in hint:
        return ["lease-1"]
    if param.name == "name" and route_name == "add_host":
        return "h1"  # a HostSpec is built from it, and validated
    assert hint == "str", f"no test value for {route_name}({param.name}: {hint})"
    return "x/y"


def test_path_parameters_are_quoted_whole() -> None:
    assert routes.show_device.url(uid="h1/numa:node2") == "/v1/devices/h1%2Fnuma%3Anode2"
    assert routes.renew.url(lease_id="a b") == "/v1/leases/a%20b/renew"
    with pytest.raises(TypeError):
        routes.renew.url()


def test_no_path_or_method_is_written_outside_the_table() -> None:
    """The client and the app take paths from the table only."""
    root = Path(__file__).resolve().parents[3]
    for module in ("poold/api/client.py", "poold/api/app.py"):
        text = (root / module).read_text()
        assert not re.search(r"[\"']/v1/", text), f"{module} spells a /v1/ path itself"


def test_a_client_error_is_the_servers_code(api: Any, admin: PooldClient) -> None:
    with pytest.raises(PoolError) as err:
        admin.get_tenant("nobody")
    assert err.value.code == "unknown_tenant"
