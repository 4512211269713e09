"""How `pool-agent serve` runs: inventory, poold link, backends, socket server, signals.

Under systemd (Type=notify) it says READY=1 once the tenant socket listens, and feeds
the watchdog (WatchdogSec=) only while a real ``hello`` through that socket is answered:
the socket loop and the service both have to turn for a ping.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from types import FrameType

from agent.admission import InFlightLimits
from agent.backends import Backend
from agent.backends.devdax import DevdaxBackend
from agent.backends.emulated import EmulatedBackend
from agent.backends.numa import NumaBackend
from agent.client import PoolClient
from agent.config import AgentConfig, metrics_address
from agent.inventory import InventoryWatcher, host_inventory
from agent.journal import Journal
from agent.link import PooldLink
from agent.metrics import start_metrics_server
from agent.refill import RefillPolicy
from agent.server import AgentServer, SocketLimits
from agent.service import AgentService
from agent.warm import WarmPool
from poold import __version__, collector, notify
from poold.api.client import PooldClient
from poold.errors import PoolError

log = logging.getLogger("pool_agent")

SD_LISTEN_FDS_START = 3


def systemd_listen_socket() -> socket.socket | None:
    """The socket systemd passed us (socket activation, sd_listen_fds(3)), if any."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = int(os.environ.get("LISTEN_FDS", "0") or 0)
    if count < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not for our children
    return socket.socket(fileno=SD_LISTEN_FDS_START)


def feed_watchdog(socket_path: os.PathLike[str], stop: threading.Event) -> threading.Thread | None:
    """Ping systemd's watchdog each half WATCHDOG_USEC while the agent answers a hello."""
    interval_s = notify.watchdog_interval_s()
    if interval_s is None:
        return None

    def loop() -> None:
        while not stop.is_set():
            try:
                with PoolClient(socket_path, timeout_s=max(interval_s, 1.0)) as probe:
                    probe.hello(client_name="pool-agent-watchdog")
            except PoolError as err:
                log.warning("watchdog: the agent socket did not answer (%s)", err.message)
            else:
                notify.notify(notify.WATCHDOG)
            stop.wait(interval_s)

    thread = threading.Thread(target=loop, name="agent-watchdog", daemon=True)
    thread.start()
    return thread


def run(config: AgentConfig) -> int:
    try:
        credential = config.resolved_credential()
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    backends: dict[str, Backend] = {
        "emulated": EmulatedBackend(),
        "devdax": DevdaxBackend(config.sysfs_root, holder_wait_s=config.devdax_holder_wait_s),
        "numa": NumaBackend(sysfs_root=config.sysfs_root, hugepages=config.hugepages),
    }
    client = PooldClient(config.poold_url, credential, timeout_s=config.poold_timeout_s)
    link = PooldLink(client, __version__, grant_patience_s=config.grant_patience_s)
    inventory = host_inventory(config, set(backends))
    warm = WarmPool(backends["emulated"], config.warm_pool_bytes)
    warm.start()
    in_flight = InFlightLimits(
        max_requests_per_uid=config.in_flight_max_requests_per_uid,
        max_bytes=config.in_flight_max_bytes,
        max_bytes_per_uid=config.in_flight_max_bytes_per_uid,
        wait_s=config.in_flight_wait_s,
    )
    refill = RefillPolicy(
        min_reserve_bytes=config.delegation_min_reserve_bytes,
        max_reserve_bytes=max(RefillPolicy.max_reserve_bytes, config.delegation_min_reserve_bytes),
        min_budget_leases=config.delegation_min_budget_leases,
    )
    service = AgentService(config.host, link, backends, warm, in_flight=in_flight, refill=refill)
    service.delegation.enabled = config.delegation
    service.journal = Journal(config.state_dir / "journal.db")
    adopted, orphaned = service.adopt()
    if adopted or orphaned:
        log.info("journal: re-adopted %d live lease(s), orphaned %d", adopted, orphaned)
    link.inventory = inventory
    try:
        link.register(inventory)
        log.info("registered with poold at %s: %d device(s)", client.base_url, len(inventory))
        stray = service.reconcile()
        if stray:
            log.info("reconciled with poold: %d lease(s) had no memory behind them", stray)
    except PoolError as exc:
        if exc.code in ("unauthorized", "forbidden"):
            log.error("poold refused this agent's credential: %s", exc.message)
            client.close()
            return 2
        log.warning("poold not reachable yet (%s); serving and retrying", exc.message)
        # The reconcile above did not run: the first heartbeat poold answers does it.
        service.resync.failed()
    server = AgentServer(
        config.socket_path,
        service,
        mode=config.socket_mode,
        group=config.socket_group,
        listen_socket=systemd_listen_socket(),
        limits=SocketLimits(
            max_connections=config.socket_max_connections,
            max_connections_per_uid=config.socket_max_connections_per_uid,
            frame_timeout_s=config.socket_frame_timeout_s,
            idle_timeout_s=config.socket_idle_timeout_s,
            reply_timeout_s=config.socket_reply_timeout_s,
            max_frame_bytes=config.socket_max_frame_bytes,
            max_queued_events=config.socket_max_queued_events,
        ),
    )
    metrics = None
    if config.metrics_listen:
        host, port = metrics_address(config.metrics_listen)
        try:
            metrics = start_metrics_server(service, host, port, server=server)
        except OSError as exc:
            log.error("cannot serve metrics on %s: %s", config.metrics_listen, exc)
            server.shutdown()
            service.close()
            client.close()
            return 2
        log.info("metrics on %s", metrics.url)
    # What the agent keeps for its life is made: out of every collection from here, before
    # its threads start and its socket is announced.
    collector.tune()
    link.start(config.heartbeat_interval_s)
    service.start_holder_watch(config.holder_check_interval_s)
    watcher = InventoryWatcher(config, set(backends), link, journal=service.journal)
    watcher.start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("pool-agent for host %s listening on %s", config.host, server.socket_path)
    print(f"pool-agent ready on {server.socket_path}", flush=True)
    notify.notify(notify.READY, f"STATUS=serving on {server.socket_path}")
    watchdog = feed_watchdog(server.socket_path, stop)
    try:
        server.serve_forever()
    finally:
        stop.set()
        notify.notify(notify.STOPPING)
        if watchdog is not None:
            watchdog.join(timeout=5)
        server.shutdown()
        if metrics is not None:
            metrics.close()
        watcher.stop()
        link.stop()
        service.close()
        client.close()
    return 0
