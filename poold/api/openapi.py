"""What does /openapi.json say poold's API is? The route table's truth, not FastAPI's guess.

FastAPI infers a schema from the endpoint signatures, and poold's endpoints are
wrappers (`binding._threaded`) that take the raw body and render the reply themselves:
inferred, the schema had no request bodies, no response models, a `422
HTTPValidationError` poold never sends, and no security. This module builds each
operation from `poold.wire.routes` instead: the body and response models the binder
uses, the bearer scheme for every route whose `auth` is not "none", and the errors as
they leave (`{"code", "message", "detail"?}` with the status of the code's class,
poold/errors.py). FastAPI's parameters (path and query) are kept: they are derived
from the same models.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from poold.errors import all_codes
from poold.wire.routes import ROUTES, Route

REF = "#/components/schemas/{model}"
ERROR_SCHEMA = "Error"
SECURITY_SCHEME = "bearer"
# Codes of the agent socket, the tenant client and the command lines: poold's API never
# sends them, so no operation lists them.
NOT_FROM_POOLD = frozenset(
    {
        "frame_too_large",
        "frame_timeout",
        "usage",
        "interrupted",
        "poold_unreachable",
        "agent_unreachable",
        "agent_busy",
        "agent_protocol_error",
        "backend_failed",
        "not_shrinkable",
        "config_invalid",
    }
)
_WHY = {
    400: "The request is malformed: a body, query or path that does not parse or validate",
    401: "No bearer token, or one that is neither the admin token nor an agent credential",
    403: "The token may not call this route (admin vs agent), or the lease is another host's",
    404: "Something the request names does not exist",
    409: "The ledger refuses the change in its current state (conflict, quota, transition)",
    413: "The body is over poold's cap (--max-body-bytes)",
    500: "An unexpected failure inside poold (logged); the connection stays usable",
    503: "The ledger is unreachable or contended: retry after Retry-After seconds",
    507: "No device has room for the lease",
}
_AUTH_TEXT = {
    "none": "No token needed.",
    "admin": "Needs the admin token.",
    "agent": "Needs a host's agent credential.",
    "any": "The admin token or an agent credential (an agent sees its own host only).",
}
_PATH_PARAM = re.compile(r"\{(\w+):path\}")


def error_statuses(route: Route[Any]) -> list[int]:
    """The error statuses a route can answer, from what its table entry says it takes."""
    statuses = {500}
    if route.auth == "none":
        return sorted(statuses)  # health and metrics read no input and no ledger
    statuses |= {400, 401, 403, 503}
    if route.path_params or route.body is not None:
        statuses.add(404)  # a lease, tenant, host or device named that is not there
    if route.body is not None:
        statuses.add(413)
    if route.method != "GET":
        statuses.add(409)
    if route.name == "grant":
        statuses.add(507)
    return sorted(statuses)


def codes_by_status() -> dict[int, list[str]]:
    """The stable codes poold's API sends, by the status their class carries."""
    out: dict[int, list[str]] = {}
    for code, cls in sorted(all_codes().items()):
        if code not in NOT_FROM_POOLD:
            out.setdefault(cls.http_status, []).append(code)
    return out


def build(app: FastAPI) -> dict[str, Any]:
    """The whole OpenAPI document for `app` (cached on it, as FastAPI caches its own)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    models: list[tuple[tuple[str, str], JsonSchemaMode, TypeAdapter[Any]]] = []
    for route in ROUTES.values():
        if route.body is not None:
            models.append(((route.name, "body"), "validation", TypeAdapter(route.body)))
        if route.response is not None and route.response is not str:
            models.append(((route.name, "response"), "serialization", TypeAdapter(route.response)))
    found, defs = TypeAdapter.json_schemas(models, ref_template=REF)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)  # FastAPI's 422 shape: poold answers 400 with an Error
    schemas.update(defs.get("$defs", {}))
    schemas[ERROR_SCHEMA] = {
        "type": "object",
        "title": "Error",
        "description": "Every failure poold answers: a stable code (poold/errors.py) and words",
        "required": ["code", "message"],
        "properties": {
            "code": {
                "type": "string",
                "enum": sorted(c for v in codes_by_status().values() for c in v),
            },
            "message": {"type": "string"},
            "detail": {"type": "object", "additionalProperties": True},
        },
        "additionalProperties": False,
    }
    components["securitySchemes"] = {
        SECURITY_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "The admin token, or the credential `poolctl hosts add` gave a host",
        }
    }
    by_status = codes_by_status()
    for route in ROUTES.values():
        path = _PATH_PARAM.sub(r"{\1}", route.path)
        op = schema["paths"][path][route.method.lower()]
        op["operationId"] = route.name
        op["description"] = (
            f"{op.get('description', '').strip()}\n\n{_AUTH_TEXT[route.auth]}".strip()
        )
        op["security"] = [] if route.auth == "none" else [{SECURITY_SCHEME: []}]
        if route.body is not None:
            op["requestBody"] = {
                "required": not route.body_optional,
                "content": {
                    "application/json": {"schema": found[(route.name, "body"), "validation"]}
                },
            }
        responses: dict[str, Any] = {str(route.status_code): _success(route, found)}
        for status in error_statuses(route):
            responses[str(status)] = _error_response(status, by_status.get(status, []))
        op["responses"] = responses
    app.openapi_schema = schema
    return schema


def _success(route: Route[Any], found: dict[Any, Any]) -> dict[str, Any]:
    if route.response is None:
        return {"description": "Done; no body"}
    if route.response is str:  # /metrics: the Prometheus text exposition
        return {
            "description": "Prometheus text exposition (docs/metrics.md)",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    return {
        "description": "OK",
        "content": {
            "application/json": {
                "schema": copy.deepcopy(found[(route.name, "response"), "serialization"])
            }
        },
    }


def _error_response(status: int, codes: list[str]) -> dict[str, Any]:
    schema: dict[str, Any] = {"$ref": REF.format(model=ERROR_SCHEMA)}
    if codes:
        schema = {
            "allOf": [schema, {"properties": {"code": {"enum": codes}}}],
        }
    response: dict[str, Any] = {
        "description": f"{_WHY.get(status, 'Refused')}: code one of {', '.join(codes)}",
        "content": {"application/json": {"schema": schema}},
    }
    if status == 503:
        response["headers"] = {
            "Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait"}
        }
    return response
