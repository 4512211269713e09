"""Who maps or holds a memfd: agent/mappings.py over a recorded /proc and the live one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.mappings import Inode, scan

FIXTURE = Path(__file__).parents[1] / "fixtures" / "proc-mapped"
MEMFD = Inode(os.makedev(0, 1), 131280)
OTHER_MEMFD = Inode(os.makedev(0, 1), 131281)


def test_recorded_proc_finds_each_mapper_once() -> None:
    found = scan({MEMFD, OTHER_MEMFD, Inode(os.makedev(0, 1), 999)}, proc_root=FIXTURE)
    assert found.pids == {MEMFD: {100}, OTHER_MEMFD: {200}}
    assert found.processes == 4 and found.unreadable == 0
    assert found.mapped(MEMFD) and not found.mapped(Inode(os.makedev(0, 1), 999))


def test_same_inode_on_another_device_is_not_the_memfd() -> None:
    # pid 200 maps inode 131280 of device 08:01: a different file.
    assert scan({MEMFD}, proc_root=FIXTURE).pids == {MEMFD: {100}}


def test_nothing_watched_reads_nothing(tmp_path: Path) -> None:
    assert scan(set(), proc_root=tmp_path / "absent").processes == 0


def test_missing_proc_root_is_unreadable_not_empty(tmp_path: Path) -> None:
    assert scan({MEMFD}, proc_root=tmp_path / "absent").unreadable == 1


def _fake_proc(tmp_path: Path) -> tuple[Path, Inode]:
    """A /proc whose pid 7 holds ``held`` by fd 3 only, and pid 8 by a closed fd."""
    held = tmp_path / "memfd-held"
    held.write_bytes(b"x")
    root = tmp_path / "proc"
    for pid in (7, 8, 9):
        (root / str(pid) / "fd").mkdir(parents=True)
        (root / str(pid) / "maps").write_bytes(b"")
    (root / "7" / "fd" / "3").symlink_to(held)
    (root / "7" / "fd" / "0").symlink_to("/dev/null")
    (root / "8" / "fd" / "4").symlink_to(tmp_path / "closed-meanwhile")  # dangling
    return root, Inode.of_path(held)


def test_fd_holders_count_and_ignored_fds_do_not(tmp_path: Path) -> None:
    root, inode = _fake_proc(tmp_path)
    assert scan({inode}, proc_root=root).pids == {inode: {7}}
    assert scan({inode}, proc_root=root, ignore={(7, 3)}).pids == {}
    # Ignoring another pid's fd 3 changes nothing for pid 7.
    assert scan({inode}, proc_root=root, ignore={(8, 3)}).pids == {inode: {7}}


def test_process_vanishing_mid_scan_is_skipped(tmp_path: Path) -> None:
    root, inode = _fake_proc(tmp_path)
    (root / "9" / "maps").unlink()
    (root / "9" / "fd").rmdir()  # listed, then gone
    assert scan({inode}, proc_root=root).pids == {inode: {7}}


# --- the live /proc ---------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import mmap, os, sys
    fd = os.memfd_create("poold-test")
    os.ftruncate(fd, 1 << 20)
    st = os.fstat(fd)
    mode = sys.argv[1]
    mm = None
    if mode in ("map", "map+fd"):
        mm = mmap.mmap(fd, 1 << 20)
        mm[:4] = b"mine"
    if mode == "map":
        os.close(fd)  # only the mapping keeps the pages
    print(st.st_dev, st.st_ino, flush=True)
    sys.stdin.readline()
    if mm is not None:
        mm.close()  # munmap
    if mode != "map":
        os.close(fd)
    print("unmapped", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("mode", ["map", "fd", "map+fd"])
def test_live_proc_sees_a_child_mapping_or_holding_a_memfd(mode: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        dev, ino = (int(x) for x in child.stdout.readline().split())
        inode = Inode(dev, ino)
        found = scan({inode})
        assert found.pids == {inode: {child.pid}}
        assert found.processes > 1
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "unmapped"
        assert scan({inode}).pids == {}  # the child lives on, without the memfd
    finally:
        child.stdin.close()
        child.wait(10)
        child.stdout.close()


def test_live_proc_ignores_only_the_fd_about_to_close() -> None:
    fd = os.memfd_create("poold-test-self")
    try:
        inode = Inode.of_fd(fd)
        assert scan({inode}).pids == {inode: {os.getpid()}}
        assert scan({inode}, ignore={(os.getpid(), fd)}).pids == {}
        second = os.dup(fd)
        try:
            assert scan({inode}, ignore={(os.getpid(), fd)}).pids == {inode: {os.getpid()}}
        finally:
            os.close(second)
    finally:
        os.close(fd)


# --- the watch survives an agent restart (agent/journal.py) --------------------------------


def test_journal_keeps_watched_memfds_and_upgrades_old_journals(tmp_path: Path) -> None:
    import sqlite3

    from agent.journal import SCHEMA, Entry, Journal, Watched

    path = tmp_path / "journal.db"
    old = sqlite3.connect(path)  # a journal from before inodes: no st_dev/st_ino columns
    old.execute(SCHEMA.replace(",\n    st_dev INTEGER,\n    st_ino INTEGER", ""))
    old.execute(
        "INSERT INTO leases VALUES ('old', 'd', 'emulated', 0, 2, 1, 7, 0, NULL, 60, "
        "NULL, NULL, '{}')"
    )
    old.commit()
    old.close()
    journal = Journal(path)
    (entry,) = journal.entries()
    assert (entry.lease_id, entry.st_dev, entry.st_ino) == ("old", None, None)
    journal.add(Entry("l1", "d", "emulated", 0, 2, 1, 7, 0, None, 60, None, None, "{}", 1, 131280))
    journal.watch(Watched("l1", 1, 131280, 2, 0, "released", 1.5))
    assert [e.lease_id for e in journal.entries()] == ["old"]  # moved, in one transaction
    journal.close()
    again = Journal(path)
    assert again.watched() == [Watched("l1", 1, 131280, 2, 0, "released", 1.5)]
    again.unwatch("l1")
    assert again.watched() == []
    again.close()
