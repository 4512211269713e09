"""Fuzz of the agent's socket by a stranger: random and malformed frames, fds, connections.

The fuzzer runs as a uid no tenant allows, in its own process. Every reply it gets must
be a well-formed frame whose error code is one a bad request earns; afterwards the
agent lives, serves a tenant, holds no more fds or threads than before, and the
ledger is as it was. The quick run is ~2,000 frames; the slow one >= 100,000.
"""

from __future__ import annotations

import array
import json
import os
import random
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from agent.protocol import OPERATIONS
from tests.e2e.conftest import Cluster
from tests.security.conftest import (
    LEDGER_TABLES,
    STRANGER_UID,
    as_uid,
    baseline,
    raw_connect,
    read_reply,
)
from tests.security.fuzzvalues import FuzzValues
from tests.security.test_socket_abuse import assert_up

# What a stranger's frames may earn (and nothing else: never internal).
EXPECTED_CODES = {
    "bad_request",
    "invalid_size",
    "frame_too_large",
    "not_owner",
    "unknown_lease",
    "agent_busy",
    "in_flight_limit",
}
SEED = int(os.environ.get("POOLD_FUZZ_SEED", "1313"))


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _mapping(rng: random.Random, depth: int) -> dict[str, Any]:
    """An object of the agent's field names (and some that are none), random values."""
    return {
        rng.choice(["size_bytes", "lease_id", "ttl_s", "tenant", "labels", "x", ""]): _value(
            rng, depth + 1
        )
        for _ in range(rng.randrange(4))
    }


# Beyond the common scalars: strings of the lengths the agent's limits sit at.
_value = FuzzValues(
    scalars=(lambda rng: "x" * rng.choice([0, 1, 64, 65, 129, 1025, 5000]),),
    obj=_mapping,
)


def _args(rng: random.Random, op: str) -> Any:
    """Plausible, then mangled, arguments for ``op``."""
    fields = list(OPERATIONS[op].args_model.model_fields) if op in OPERATIONS else []
    args: dict[str, Any] = {name: _value(rng) for name in fields if rng.random() < 0.7}
    if op == "lease" and rng.random() < 0.5:
        args = {"size_bytes": rng.choice([1, 2 << 20, 1 << 30, 1 << 40]), "wait_s": 0}
        if rng.random() < 0.5:
            args["tenant"] = rng.choice(["alpha", "nobodies", "nope", "a" * 200])
    if op in ("renew", "release", "report", "shrink") and rng.random() < 0.5:
        args["lease_id"] = rng.choice(["00000000-0000-0000-0000-000000000000", "x", "a" * 64])
    if rng.random() < 0.1:
        args[rng.choice(["uid", "pid", "extra"])] = 0
    return args


def _frames(rng: random.Random) -> tuple[bytes, bool]:
    """One frame (or what passes for one) and whether the agent should answer it."""
    kind = rng.randrange(14)
    op = rng.choice([*OPERATIONS, "nope", "", "HELLO"])
    if kind <= 5:  # a request, well formed or close to it
        return _frame(json.dumps({"op": op, "args": _args(rng, op)}).encode()), True
    if kind == 6:  # wrong types where objects belong
        return _frame(
            json.dumps(rng.choice([[], 1, "s", None, {"op": 1}, {"args": []}])).encode()
        ), True
    if kind == 7:  # not JSON, not UTF-8
        return _frame(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))), True
    if kind == 8:  # deep nesting
        depth = rng.choice([100, 5000, 30000])
        return _frame(b"[" * depth + b"]" * depth), True
    if kind == 9:  # empty body
        return _frame(b""), True
    if kind == 10:  # past the cap: refused unread, then hung up on
        return struct.pack(">I", rng.choice([65537, 1 << 24, 0xFFFFFFFF])), True
    if kind == 11:  # a truncated header, then the connection ends
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4))), False
    if kind == 12:  # a body shorter than its header says, then the connection ends
        return struct.pack(">I", 100) + b'{"op":"hello"', False
    return _frame(json.dumps({"op": op, "args": {}, "extra": _value(rng)}).encode()), True


def _fds(rng: random.Random) -> list[int]:
    """Fds to attach: pipes, /dev/null, a memfd, and sometimes many."""
    fds: list[int] = []
    for _ in range(rng.choice([1, 1, 2, 8, 64])):
        choice = rng.randrange(3)
        if choice == 0:
            r, w = os.pipe()
            os.close(w)
            fds.append(r)
        elif choice == 1:
            fds.append(os.open("/dev/null", os.O_RDONLY))
        else:
            fds.append(os.memfd_create("fuzz"))
    return fds


def fuzz(path: Path, frames: int, seed: int) -> dict[str, Any]:
    """Send ``frames`` fuzzed frames over many connections; tally what came back."""
    rng = random.Random(seed)  # noqa: S311  # reproducible by seed, not secret
    tally: dict[str, int] = {}
    bad: list[str] = []
    sent = 0
    while sent < frames:
        if rng.random() < 0.02:  # a burst of connections at once, then closed
            burst = [raw_connect(path) for _ in range(rng.randrange(2, 40))]
            for sock in burst:
                sock.close()
        try:
            sock = raw_connect(path, timeout_s=10)
        except OSError as err:
            bad.append(f"connect: {err}")
            continue
        with sock:
            for _ in range(rng.randrange(1, 12)):
                data, answered = _frames(rng)
                sent += 1
                try:
                    if rng.random() < 0.1:
                        fds = _fds(rng)
                        try:
                            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                            sock.sendmsg([data], rights)
                        finally:
                            for fd in fds:
                                os.close(fd)
                    elif rng.random() < 0.02:
                        # An fd number that is not open: the sender's kernel refuses it.
                        try:
                            sock.sendmsg(
                                [data],
                                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [9999]))],
                            )
                        except OSError:
                            sock.sendall(data)
                    else:
                        sock.sendall(data)
                except OSError:
                    break  # the agent hung up on an earlier frame: fine
                if not answered:
                    break
                try:
                    reply = read_reply(sock)
                except Exception as err:  # an unreadable reply is a bug
                    bad.append(f"reply: {err!r} to {data[:80]!r}")
                    break
                if reply is None:
                    bad.append(f"no reply to {data[:80]!r}")
                    break
                if reply.get("ok") is True:
                    tally["ok"] = tally.get("ok", 0) + 1
                    continue
                err_code = str(reply.get("error", {}).get("code"))
                tally[err_code] = tally.get(err_code, 0) + 1
                if err_code not in EXPECTED_CODES:
                    bad.append(f"{err_code} to {data[:80]!r}: {reply['error'].get('message')}")
                if err_code in ("frame_too_large", "bad_request"):
                    break  # perhaps hung up on (an unframeable stream): a new connection
    return {"sent": sent, "tally": tally, "bad": bad[:20]}


def run_fuzz(cluster: Cluster, frames: int) -> None:
    fds, threads = baseline(cluster)
    before = cluster.ledger_rows(*LEDGER_TABLES)
    start = time.monotonic()
    out = as_uid(STRANGER_UID, lambda: fuzz(cluster.socket_path, frames, SEED), timeout_s=3600)
    report = out["ok"]
    took = time.monotonic() - start
    assert report["bad"] == [], (SEED, report)
    assert report["sent"] >= frames
    assert "internal" not in report["tally"]
    assert report["tally"].get("ok", 0) > 0 and report["tally"].get("not_owner", 0) > 0
    print(f"fuzz seed {SEED}: {report['sent']} frames in {took:.1f} s: {report['tally']}")
    assert cluster.ledger_rows(*LEDGER_TABLES) == before
    assert_up(cluster, fds, threads)


def test_fuzz_the_socket_quick(hostile: Cluster) -> None:
    run_fuzz(hostile, 2000)


@pytest.mark.slow
def test_fuzz_the_socket_long(hostile: Cluster) -> None:
    run_fuzz(hostile, 100_000)
