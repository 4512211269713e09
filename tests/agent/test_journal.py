"""Does the local-grant log (agent/journal.py `GrantLog`) replay to what the agent held,
after a compaction too, and do appends go on while a compaction syncs its file?"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from agent import journal
from agent.journal import Entry, GrantLog, replay_grant_log


def _entry(lease_id: str) -> Entry:
    return Entry(lease_id, "dev-1", "emulated", 0, 2 << 20, 1, 42, 1000, None, 60, None, None, "{}")


def _grant(log: GrantLog, lease_id: str, epoch: int, durable: bool = False) -> int:
    grant = json.dumps({"lease_id": lease_id, "reservation_id": "R1", "epoch": epoch})
    return log.grant(_entry(lease_id), grant, "R1", epoch, durable)


def _release(log: GrantLog, lease_id: str) -> int:
    log.end(lease_id)
    return log.op(lease_id, json.dumps({"lease_id": lease_id, "op": "release"}))


def _assert_replays_to(log: GrantLog) -> None:
    state, _seq = replay_grant_log(log.path)
    assert state.entries == log.state.entries
    assert state.pending == log.state.pending
    assert state.epochs == log.state.epochs
    assert state.delegation == log.state.delegation
    # Replay keeps a grant while its lease is live or has ops waiting (the log in use
    # prunes the others at its next compaction).
    waiting = {json.loads(op)["lease_id"] for _, op in log.state.pending}
    held = log.state.entries.keys() | waiting
    assert state.grants == {k: v for k, v in log.state.grants.items() if k in held}


def test_a_compaction_keeps_what_replay_needs_and_drops_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = GrantLog(tmp_path / journal.GRANT_LOG_NAME)
    done = [_grant(log, f"L{i}", i) for i in range(40)]
    done += [_release(log, f"L{i}") for i in range(30)]
    log.acked(done[:50])  # below the size that compacts
    grown = log.path.stat().st_size
    _assert_replays_to(log)
    monkeypatch.setattr(journal, "GRANT_LOG_COMPACT_BYTES", 0)
    log.acked(done[50:60])
    assert log.path.stat().st_size < grown
    assert set(log.state.entries) == {f"L{i}" for i in range(30, 40)}
    _assert_replays_to(log)
    _grant(log, "L40", 40)  # appends go on in the new file
    _assert_replays_to(log)
    log.close()


def _compaction_held(
    log: GrantLog, acked: list[int], monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Thread, threading.Event, list[str]]:
    """A compaction started (by acking ``acked``) and held in the fsync of its file until
    ``go_on`` is set; every fsync's path is listed in the list returned."""
    syncing, go_on = threading.Event(), threading.Event()
    synced: list[str] = []
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".tmp") and not syncing.is_set():
            syncing.set()
            assert go_on.wait(10)
        real_fsync(fd)
        synced.append(path)

    monkeypatch.setattr(journal, "GRANT_LOG_COMPACT_BYTES", 0)
    monkeypatch.setattr(journal.os, "fsync", held_fsync)
    compacting = threading.Thread(target=log.acked, args=(acked,))
    compacting.start()
    assert syncing.wait(10)
    return compacting, go_on, synced


def test_appends_go_on_while_a_compaction_syncs_and_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compacted file's fsync (tens of ms on a busy ext4) runs outside the log's lock:
    a grant made meanwhile is not held up, and is in the log once the compaction is in."""
    log = GrantLog(tmp_path / journal.GRANT_LOG_NAME)
    done = [_grant(log, f"L{i}", i) for i in range(10)]
    done += [_release(log, f"L{i}") for i in range(5)]
    compacting, go_on, _synced = _compaction_held(log, done[:7], monkeypatch)
    granted = threading.Thread(target=_grant, args=(log, "L10", 10))
    granted.start()
    granted.join(2)
    assert not granted.is_alive(), "a grant waited for the compaction's fsync"
    _release(log, "L9")
    go_on.set()
    compacting.join(10)
    assert not compacting.is_alive()
    assert "L10" in log.state.entries and "L9" not in log.state.entries
    _assert_replays_to(log)
    log.close()


def test_a_durable_line_written_during_a_compaction_is_synced_in_the_new_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Persistent media: a grant journalled (and synced) while the compaction wrote its
    file is carried over and synced there before the rename; the directory is synced
    before the next durable line counts on the rename."""
    log = GrantLog(tmp_path / journal.GRANT_LOG_NAME)
    done = [_grant(log, f"L{i}", i) for i in range(4)]
    compacting, go_on, synced = _compaction_held(log, done, monkeypatch)
    _grant(log, "D1", 10, durable=True)
    log.delegation('{"reservations": []}', 1.5)
    log.update(_entry("L1"))
    synced.clear()
    go_on.set()
    compacting.join(10)
    assert [p.endswith(".tmp") for p in synced] == [True, True]  # snapshot, then the tail
    _grant(log, "D2", 11, durable=True)
    assert synced[2:] == [str(log.path), str(tmp_path)]  # the line, then the rename
    _assert_replays_to(log)
    assert "D1" in replay_grant_log(log.path)[0].entries
    log.close()


def test_a_log_closed_during_a_compaction_stays_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = GrantLog(tmp_path / journal.GRANT_LOG_NAME)
    done = [_grant(log, f"L{i}", i) for i in range(4)]
    compacting, go_on, _synced = _compaction_held(log, done, monkeypatch)
    before = log.path.read_bytes()
    log.close()
    go_on.set()
    compacting.join(10)
    assert log.path.read_bytes() == before
    assert not log.path.with_suffix(".tmp").exists()


@pytest.mark.parametrize("fails", ["rename", "short writes"])
def test_a_compaction_that_fails_or_writes_short_leaves_the_log_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """A rename that fails leaves the log and its fd as they were (the compacted file
    removed), and the next compaction works; writes the kernel takes in part (a nearly
    full disk) are finished, never left torn."""
    log = GrantLog(tmp_path / journal.GRANT_LOG_NAME)
    done = [_grant(log, f"L{i}", i) for i in range(6)]
    monkeypatch.setattr(journal, "GRANT_LOG_COMPACT_BYTES", 0)
    if fails == "rename":

        def no_rename(src: object, dst: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(journal.os, "replace", no_rename)
        with pytest.raises(OSError, match="No space"):
            log.acked(done[:2])
        assert not log.path.with_suffix(".tmp").exists()
        _release(log, "L5")  # appended to the log it still has
        _assert_replays_to(log)
        monkeypatch.undo()
        monkeypatch.setattr(journal, "GRANT_LOG_COMPACT_BYTES", 0)
    else:
        real_write = os.write
        monkeypatch.setattr(journal.os, "write", lambda fd, data: real_write(fd, data[:7]))
    log.acked(done[2:4])
    _grant(log, "L6", 6)
    _assert_replays_to(log)
    log.close()
