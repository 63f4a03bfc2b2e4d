"""Loopback byte counters on real traffic: a socket pair through 127.0.0.1 sends N bytes."""

from __future__ import annotations

import socket
import threading

import pytest

from labkit.metrics import net

pytestmark = pytest.mark.skipif(net.unavailable("lo") is not None,
                                reason=f"no loopback counters here: {net.unavailable('lo')}")  # fmt: skip

N = 4 * 1024 * 1024  # 4 MiB: far above any header or ACK overhead, far below a second of lo


def send_through_loopback(n: int) -> None:
    """Send ``n`` bytes from one TCP socket to another through 127.0.0.1 and read them all."""
    server = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            while len(got) < n and (chunk := conn.recv(1 << 16)):
                got.extend(chunk)

    reader = threading.Thread(target=receive)
    reader.start()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(b"x" * n)
    reader.join(timeout=30)
    server.close()
    assert len(got) == n, f"the receiver got {len(got)} of {n} bytes"


def test_counters_are_cumulative_and_named():
    before = net.interface_bytes()
    send_through_loopback(1024)
    after = net.interface_bytes("lo")
    assert before.interface == after.interface == "lo"
    assert after.sent >= before.sent + 1024 and after.received >= before.received + 1024


def test_count_wire_sees_at_least_the_payload_sent_and_received():
    with net.count_wire("lo") as wire:
        assert wire.sent is None and wire.received is None  # N/A while the block runs
        send_through_loopback(N)
    # on lo each byte is transmitted once and received once; headers and ACKs only add
    assert wire.sent >= N and wire.received >= N
    assert wire.end is not None and wire.sent == wire.end.sent - wire.start.sent


def test_counts_are_filled_when_the_block_raises():
    with pytest.raises(KeyError), net.count_wire() as wire:
        send_through_loopback(1024)
        raise KeyError("boom")
    assert wire.sent is not None and wire.sent >= 1024


def test_a_missing_interface_is_named_with_the_fix():
    why = net.unavailable("no-such-if0")
    assert why is not None and "no-such-if0" in why and "'lo'" in why
    with pytest.raises(RuntimeError, match="no network interface 'no-such-if0'"):
        net.interface_bytes("no-such-if0")
    with pytest.raises(RuntimeError, match="no-such-if0"), net.count_wire("no-such-if0"):
        pass  # pragma: no cover


def test_not_linux_is_reported_not_read(monkeypatch):
    monkeypatch.setattr(net.sys, "platform", "darwin")
    assert "darwin" in net.unavailable("lo")
    with pytest.raises(RuntimeError, match="darwin"):
        net.interface_bytes("lo")


def test_a_gloo_job_puts_at_least_its_payload_on_loopback():
    # Two gloo ranks on this host talk over lo: every payload byte either rank sends (the link
    # probe and the ring all-reduces, as the worker counts them) is on lo at least once.
    from labkit.jobs import launch
    from labkit.workers import allreduce

    with net.count_wire("lo") as wire:
        res = launch.run(allreduce.AllReduceConfig(numel=2**14, repeats=5, warmup=1, op="max"),
                         nproc=2, timeout_s=120, stream=False)  # fmt: skip
    r0, r1 = res.ranks
    # op="max" of 1 and 2 is 2: the worker reports what it holds instead of raising on a
    # value that is not the sum, so a caller's check of the sum (notebook 00's) can fail
    assert r0["value"] == r1["value"] == 2.0 and r0["wrong_elements"] == 0
    assert r0["allreduces"] == 1 + 1 + 5
    probe = (allreduce.PROBE_TIMES + 1) * (r0["probe_small_bytes"] + r0["probe_big_bytes"])
    assert r0["sent_payload_bytes"] == probe + 7 * 2**14 * 4  # 2 ranks: each sends S per all-reduce
    assert wire.sent >= r0["sent_payload_bytes"] + r1["sent_payload_bytes"]
    # the worker's own window around its loop of 6 all-reduces, and a baseline as long
    assert r0["wire_unavailable"] is None and r0["loop_allreduces"] == 6
    assert r0["wire_loop_bytes"] >= 2 * 6 * 2**14 * 4
    assert r0["wire_idle_bytes"] >= 0 and 0 < r0["wire_idle_s"]
    assert r0["wire_loop_bytes"] <= wire.sent  # a window inside the job


def test_the_worker_says_why_it_cannot_count_instead_of_counting(monkeypatch):
    from labkit.workers import allreduce

    class Ctx:
        backend, world_size = "nccl", 2

    assert "NVLink or PCIe" in allreduce._wire_unavailable(Ctx())
    Ctx.backend = "gloo"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # 2 ranks, 1 on this host: two hosts
    assert "several hosts" in allreduce._wire_unavailable(Ctx())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert allreduce._wire_unavailable(Ctx()) is None
