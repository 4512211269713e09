"""After a restart, which leases does the agent still hold, and which does poold wrongly
think it holds?

:func:`adopt` reads the journal (before the agent serves): a lease whose holder lives is
held again, its renewals work at once, and its memory stays with the holder, which never
noticed the restart; the others are orphaned (unless another process still maps their memfd:
then watched, agent/revocation.py), and ended memfd leases still mapped are watched again.
:func:`reconcile` then asks poold for the host's live leases and ends those the agent has
no memory for (it was killed between grant and journal, or before a release reached poold).
"""

from __future__ import annotations

import logging

from agent.held import HeldLease, HeldLeases
from agent.holders import Holder
from agent.holders import alive as holder_alive
from agent.link import PooldLink
from agent.mappings import Inode
from agent.memory import LeaseMemory
from agent.revocation import Revocations
from poold.errors import PoolError
from poold.wire.agent import LeaseOp
from poold.wire.common import LeaseOut

log = logging.getLogger("pool_agent")


def adopt(
    link: PooldLink, held: HeldLeases, memory: LeaseMemory, revocations: Revocations
) -> tuple[int, int]:
    """Keep journalled leases whose holder lives, orphan the rest, and destroy every
    other sub-device the journal knows (call before serving).

    Returns (adopted, orphaned). A journalled sub-device no adopted lease ties is a
    crash's leftover: a lease's whose teardown never ran, or a scrub's temporary one. It
    goes now, so the region is clean when poold sends the scrub order again and it is
    redone.
    """
    journal = held.journal
    if journal is None:
        return 0, 0
    # Ended memfd leases still mapped when the agent stopped: watched again (the next
    # holder check rescans them; their bytes stay counted meanwhile).
    for watched in journal.watched():
        held.rewatch(watched)
    adopted = orphaned = 0
    for entry in journal.entries():
        lease = LeaseOut.model_validate_json(entry.lease_json)
        holder = Holder(pid=entry.holder_pid, uid=entry.holder_uid, start_time=entry.holder_start)
        again = HeldLease(
            lease=lease,
            memory=None,
            holder_uid=entry.holder_uid,
            holder_pid=entry.holder_pid,
            conn_id=0,
            ttl_s=entry.ttl_s,
            expires_at=lease.expires_at,
            page_size_bytes=lease.alignment_bytes,
            holder=holder,
            sub_device=entry.sub_device,
            region_id=entry.region_id,
            inode=Inode(entry.st_dev, entry.st_ino)
            if entry.st_dev is not None and entry.st_ino is not None
            else None,
        )
        held.add(again)
        if holder_alive(holder):
            adopted += 1
            link.renew_later(lease.id, entry.ttl_s)
        else:
            orphaned += revocations.check_holders([again])
    memory.leftovers.clean_start(journal, memory.tied())  # logs each one it destroys
    return adopted, orphaned


def reconcile(host: str, link: PooldLink, held: HeldLeases, memory: LeaseMemory) -> int:
    """Tell poold about live leases on this host that this agent has no memory for.

    Without this they would stand, memoryless, until their ttl ran out. Granted ones are
    aborted, the others orphaned (reclaimed after poold's grace). Returns how many.
    """
    try:
        live = link.client.list_leases(host=host, live=True, limit=100_000)
    except PoolError as err:
        log.warning("cannot reconcile with poold yet: %s", err.message)
        return 0
    known = set(held.ids()) | memory.scrubbing_ids()
    stray = 0
    for lease in live:
        if lease.id in known or lease.state not in ("granted", "active"):
            continue
        op = "abort" if lease.state == "granted" else "orphan"
        log.warning(
            "lease %s is %s in poold but unknown to this agent: %s", lease.id, lease.state, op
        )
        link.enqueue(LeaseOp(lease_id=lease.id, op=op, reason="agent restarted without this lease"))
        stray += 1
    return stray
