"""Bytes on the wire: a network interface's traffic counters, read around a job.

    from labkit.metrics.net import count_wire, unavailable
    if (why := unavailable("lo")) is None:
        with count_wire("lo") as wire:      # gloo ranks on one host talk over loopback
            ...                             # run the job
        print(wire.sent, wire.received)     # bytes the interface carried during the block

Ranks of one job on one host, under the gloo backend, talk over TCP through the loopback
interface ``lo``: a byte one rank sends to another is transmitted on ``lo`` once and received
on ``lo`` once, so ``lo``'s counters measure the job's real traffic, message size plus what
the protocols add (below). On a GPU node the traffic of NCCL moves over NVLink or PCIe, which
no network interface counts: this module has nothing to say there (NCCL's own
``NCCL_DEBUG=INFO`` says which transport it chose).

What the counters hold (Linux; each with its command-line equivalent):

- ``sent``: bytes the interface transmitted, ``/sys/class/net/<if>/statistics/tx_bytes``
  (``cat /sys/class/net/lo/statistics/tx_bytes``; the "TX: bytes" column of
  ``ip -s link show lo``). Unit: bytes, cumulative since the interface came up.
- ``received``: bytes it received, ``.../statistics/rx_bytes`` ("RX: bytes" in
  ``ip -s link show lo``). Unit: bytes, cumulative.

Both are the kernel's per-interface statistics, documented in
https://www.kernel.org/doc/Documentation/ABI/testing/sysfs-class-net-statistics (the number
of bytes the device transmitted / received; the driver defines what exactly it counts). On
``lo`` they are one and the same number: the loopback driver counts each packet once, as it
hands it from its transmit side to its receive side, and reports that count as both
(``loopback_xmit`` and ``loopback_get_stats64`` in the kernel's ``drivers/net/loopback.c``).
They count whole packets as the interface sees them: each TCP segment's IP and TCP headers
(about 52 bytes with Linux's default TCP timestamps option) and every ACK segment, not only the
bytes an application wrote; that is why a delta is at least the payload, never exactly it.

**Background traffic.** The counters are the interface's, not the job's: everything on the
host that uses ``lo`` during the block counts too. In a notebook that is at least the Jupyter
kernel's ZeroMQ sockets to the server (its heartbeat and every output it sends: they run on
127.0.0.1 by default, https://jupyter-client.readthedocs.io/en/stable/kernels.html#connection-files)
and, in a job, torchrun's TCPStore, through which the ranks rendezvous and exchange NCCL/gloo
addresses (https://docs.pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore).
To isolate one operation, subtract a baseline: count a job that does everything but that
operation (the same ranks, the same launcher, a barrier where the all-reduce was) and take the
difference of the two deltas, e.g. ``job.sent - baseline.sent``. Noise from other programs
only ever adds bytes, so a measured delta is an upper bound on the job's own traffic.

Like nvitop's metrics (``nvitop/api/device.py``), a reading that cannot be made is reported
as such, never as 0: :func:`unavailable` says why (not Linux, no such interface), and
:func:`interface_bytes` raises with that reason. Importing this module reads nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SYS_CLASS_NET = Path("/sys/class/net")
"""Where Linux exposes each network interface's statistics (sysfs)."""


@dataclass(frozen=True)
class WireBytes:
    """An interface's cumulative traffic counters, read at one moment."""

    interface: str
    """The interface's name, e.g. ``"lo"`` (loopback) or ``"eth0"``."""
    sent: int
    """Bytes transmitted since the interface came up (``statistics/tx_bytes``)."""
    received: int
    """Bytes received since the interface came up (``statistics/rx_bytes``)."""


@dataclass
class WireCount:
    """What :func:`count_wire` measured: ``sent``/``received`` are None inside the block and
    the bytes the interface carried during it once the block exits."""

    interface: str
    start: WireBytes
    """The counters when the block began."""
    end: WireBytes | None = None
    """The counters when the block ended (None while it runs)."""
    sent: int | None = None
    """Bytes transmitted during the block (a delta; None while the block runs)."""
    received: int | None = None
    """Bytes received during the block (a delta; None while the block runs)."""


def unavailable(interface: str = "lo") -> str | None:
    """Why ``interface``'s byte counters cannot be read here, or None if they can."""
    if not sys.platform.startswith("linux"):
        return (f"byte counters are read from Linux's /sys/class/net, and this is {sys.platform}: "
                "run on Linux (on macOS, `netstat -ib` shows the same counters for lo0)")  # fmt: skip
    stats = SYS_CLASS_NET / interface / "statistics"
    if not (stats / "tx_bytes").is_file() or not (stats / "rx_bytes").is_file():
        known = sorted(p.name for p in SYS_CLASS_NET.iterdir()) if SYS_CLASS_NET.is_dir() else []
        return (f"no network interface {interface!r} here ({stats} has no tx_bytes/rx_bytes): "
                f"give one of {known} (`ip link` lists them)")  # fmt: skip
    return None


def interface_bytes(interface: str = "lo") -> WireBytes:
    """``interface``'s cumulative bytes sent and received, now.

    Raises:
        RuntimeError: the counters cannot be read here; the message says why (see
            :func:`unavailable`).
    """
    if (why := unavailable(interface)) is not None:
        raise RuntimeError(f"cannot count bytes on {interface!r}: {why}")
    stats = SYS_CLASS_NET / interface / "statistics"
    return WireBytes(
        interface=interface,
        sent=int((stats / "tx_bytes").read_text()),
        received=int((stats / "rx_bytes").read_text()),
    )


@contextmanager
def count_wire(interface: str = "lo") -> Iterator[WireCount]:
    """Count the bytes ``interface`` carries during the block (all traffic on it, see the
    module docstring on background traffic). The counts are filled in even if the block raises.

    Raises:
        RuntimeError: on entry, when the counters cannot be read here (see :func:`unavailable`).
    """
    count = WireCount(interface=interface, start=interface_bytes(interface))
    try:
        yield count
    finally:
        count.end = interface_bytes(interface)
        count.sent = count.end.sent - count.start.sent
        count.received = count.end.received - count.start.received
