"""The client against something that is not poold: a real HTTP server on loopback answering
non-JSON, JSON of another shape, or an error without poold's {"code"} body. Every route
gets one clear `poold_unreachable` naming the URL and what answered, never pydantic's
'Invalid JSON: expected value' under bad_request; poolctl prints it as one line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from poold.api.client import PooldClient
from poold.errors import PooldUnreachable

ROOT = Path(__file__).resolve().parents[3]

# (status, content type, body) by the first path segment the test asks for.
ANSWERS: dict[str, tuple[int, str, bytes]] = {
    "text": (200, "text/plain; version=0.0.4", b"# HELP agent_leases_held Leases held\n"),
    "json": (200, "application/json", b'{"hello": "world", "items": [1, 2]}'),
    "html404": (404, "text/html", b"<html>not here</html>"),
    "json500": (500, "application/json", b'{"error": "boom"}'),
}


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        kind = self.server.kind  # type: ignore[attr-defined]
        status, ctype, body = ANSWERS[kind]
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_DELETE = _answer

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture(params=sorted(ANSWERS))
def stranger(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(kind, URL) of a loopback HTTP server that is not poold."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.kind = request.param  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield request.param, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_every_route_says_what_answered(stranger: tuple[str, str]) -> None:
    kind, url = stranger
    status, ctype, _body = ANSWERS[kind]
    with PooldClient(url, "pt1.admin.x") as client:
        calls = [
            client.health,
            client.status,
            client.list_hosts,
            client.list_leases,
            lambda: client.show_lease("l-1"),
            lambda: client.delete_host("h1", force=True),
            lambda: client.drain_device("dev-0"),
            client.audit,
        ]
        for call in calls:
            with pytest.raises(PooldUnreachable) as err:
                call()
            message = err.value.message
            assert message.startswith(f"{url} does not answer as poold: HTTP {status} "), message
            assert ctype.split(";")[0] in message and "Invalid JSON" not in message
            assert err.value.detail["status"] == status


def test_poolctl_prints_one_coded_line(stranger: tuple[str, str]) -> None:
    _kind, url = stranger
    env = {k: v for k, v in os.environ.items() if k not in ("POOLD_TOKEN", "POOLD_URL")}
    out = subprocess.run(
        [sys.executable, "-m", "cli", "--url", url, "--token", "pt1.admin.x", "leases", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith(f"poolctl: error[poold_unreachable]: {url} does not answer as poold")
    assert out.returncode != 0
