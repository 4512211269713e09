"""The wire: pydantic models every side of poold's HTTP API shares, split by audience.

* `common` — base model, bounded scalars, errors, the lease as poold reports it;
* `agent` — agent <-> poold (inventory, heartbeat, grants, outbox ops);
* `admin` — poolctl <-> poold (tenants, hosts, devices, drain, audit, accounting);
* `routes` — the one table of HTTP routes both the server and the client are built from.
"""
