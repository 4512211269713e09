"""Debounced rescans, driven by an injected event source and a fake clock."""

from __future__ import annotations

import threading

from agent.discovery.hotplug import RescanScheduler


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class ScriptedSource:
    """Events at given times; poll() advances the fake clock like a blocking wait."""

    def __init__(self, time: FakeTime, at: list[float]) -> None:
        self.time = time
        self.pending = sorted(at)

    def poll(self, timeout_s: float) -> str | None:
        deadline = self.time.now + timeout_s
        if self.pending and self.pending[0] <= deadline:
            self.time.now = max(self.time.now, self.pending.pop(0))
            return "add dax dax0.1"
        self.time.now = deadline
        return None


def make(at: list[float], **kw: float) -> tuple[RescanScheduler, FakeTime, list[float]]:
    time = FakeTime()
    fired: list[float] = []
    sched = RescanScheduler(
        lambda: fired.append(time.now),
        ScriptedSource(time, at),
        clock=time.clock,
        sleep=time.sleep,
        **kw,
    )
    return sched, time, fired


def run_until(sched: RescanScheduler, time: FakeTime, end: float) -> None:
    while time.now < end:
        sched.step()


def test_burst_of_events_rescans_once() -> None:
    sched, time, fired = make([1.0, 1.1, 1.2, 1.3], debounce_s=0.5, fallback_interval_s=100)
    run_until(sched, time, 10)
    # Then, after a quiet fallback interval, the rescan that keeps numa capacity current.
    assert fired == [1.8, 101.8]
    assert sched.events == 4


def test_separate_bursts_rescan_separately() -> None:
    sched, time, fired = make([1.0, 1.2, 5.0], debounce_s=0.5, fallback_interval_s=100)
    run_until(sched, time, 10)
    assert fired == [1.7, 5.5, 105.5]  # the last: a quiet fallback interval


def test_endless_storm_still_rescans_by_max_delay() -> None:
    storm = [1.0 + 0.1 * i for i in range(200)]
    sched, time, fired = make(storm, debounce_s=0.5, max_delay_s=5.0, fallback_interval_s=100)
    run_until(sched, time, 12)
    assert fired
    assert abs(fired[0] - 6.0) < 1e-9


def test_periodic_fallback_without_udev() -> None:
    time = FakeTime()
    fired: list[float] = []
    sched = RescanScheduler(
        lambda: fired.append(time.now),
        None,
        fallback_interval_s=30,
        clock=time.clock,
        sleep=time.sleep,
    )
    assert sched.periodic
    for _ in range(3):
        sched.step()
    assert fired == [30.0, 60.0, 90.0]


def test_failing_rescan_keeps_watching() -> None:
    time = FakeTime()
    calls: list[float] = []

    def rescan() -> None:
        calls.append(time.now)
        raise RuntimeError("sysfs went away")

    sched = RescanScheduler(
        rescan,
        ScriptedSource(time, [1.0, 3.0]),
        debounce_s=0.5,
        fallback_interval_s=100,
        clock=time.clock,
        sleep=time.sleep,
    )
    run_until(sched, time, 10)
    assert calls == [1.5, 3.5, 103.5]  # the last: a quiet fallback interval


def test_run_stops() -> None:
    time = FakeTime()
    stop = threading.Event()
    sched = RescanScheduler(
        stop.set, None, fallback_interval_s=1, clock=time.clock, sleep=time.sleep
    )
    sched.run(stop)
    assert sched.rescans == 1
