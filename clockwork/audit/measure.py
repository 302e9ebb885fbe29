"""What an audit worker measures on its own node: echo and sink servers, probes, transfers, NIC facts.

Everything here is plain sockets bound to one fabric NIC (``SO_BINDTODEVICE``), so a measurement between
two NICs of a rail travels that rail and nothing else, as training traffic does. Servers run in one
thread each and only count; the driver asks for their counts after a round, which is how a loss is
split into its two directions (probes that never reached the echo server vs. echoes that never came back).
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

log = logging.getLogger("clockwork.audit")

_MAGIC = b"CWAU"
_HEADER = struct.Struct("!4sIIq")  # magic, run, sequence, send time (ns, sender's clock)
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
SO_BINDTODEVICE = 25
_CHUNK = 256 * 1024


def nic_facts(nic: str) -> dict[str, Any]:
    """The kernel's view of one NIC: exists, operational state, carrier and MTU."""
    base = Path("/sys/class/net") / nic
    if not base.exists():
        return {"exists": False}

    def read(name: str) -> str | None:
        try:
            return (base / name).read_text().strip()
        except OSError:  # carrier cannot be read while the link is administratively down
            return None

    mtu = read("mtu")
    return {
        "exists": True,
        "operstate": read("operstate") or "unknown",
        "carrier": read("carrier") == "1",
        "mtu": int(mtu) if mtu and mtu.isdigit() else None,
    }


def _bound_socket(kind: int, ip: str, device: str | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    if device:
        sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, device.encode())
    sock.bind((ip, 0))
    return sock


class EchoServer:
    """UDP echo on each of the node's addresses, counting what arrived per (local address, sender, run)."""

    def __init__(self, bindings: list[tuple[str, str | None]]) -> None:
        self.socks = {ip: _bound_socket(socket.SOCK_DGRAM, ip, dev) for ip, dev in bindings}
        for sock in self.socks.values():
            sock.setblocking(False)
        self.counts: dict[tuple[str, str, int], int] = {}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="audit-echo", daemon=True)
        self._thread.start()

    def ports(self) -> dict[str, int]:
        return {ip: sock.getsockname()[1] for ip, sock in self.socks.items()}

    def _loop(self) -> None:
        by_fd = {sock.fileno(): (ip, sock) for ip, sock in self.socks.items()}
        while not self._stop:
            ready, _, _ = select.select(list(by_fd), [], [], 0.2)
            for fd in ready:
                ip, sock = by_fd[fd]
                while True:
                    try:
                        data, addr = sock.recvfrom(65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    if len(data) < _HEADER.size or data[:4] != _MAGIC:
                        continue  # not ours: count nothing, answer nothing
                    run = _HEADER.unpack_from(data)[1]
                    with self._lock:
                        key = (ip, addr[0], run)
                        self.counts[key] = self.counts.get(key, 0) + 1
                    try:
                        sock.sendto(data, addr)
                    except OSError:
                        pass  # the reverse direction is broken: the sender sees it as a missing echo

    def received(self, run: int) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {"local": ip, "sender": sender, "received": n}
                for (ip, sender, r), n in sorted(self.counts.items())
                if r == run
            ]

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        for sock in self.socks.values():
            sock.close()


@dataclass
class Target:
    """One probed path: from this node's NIC to a peer NIC's echo server."""

    src: str  # "node/nic"
    dst: str
    device: str
    src_ip: str
    dst_ip: str
    port: int

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Target:
        return cls(**{k: doc[k] for k in ("src", "dst", "device", "src_ip", "dst_ip", "port")})


def probe(targets: list[Target], run: int, count: int, interval_s: float, size: int = 64) -> list[dict[str, Any]]:
    """Send ``count`` probes to every target, interleaved; replies, round trips and send errors per target."""
    socks = []
    for t in targets:
        sock = _bound_socket(socket.SOCK_DGRAM, t.src_ip, t.device)
        sock.setblocking(False)
        socks.append(sock)
    sent = [0] * len(targets)
    errors: list[str | None] = [None] * len(targets)
    rtts: list[list[float]] = [[] for _ in targets]
    pad = b"\0" * max(0, size - _HEADER.size)

    def drain(deadline: float) -> None:
        while True:
            timeout = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(socks, [], [], timeout)
            if not ready:
                return
            now = time.monotonic_ns()
            for sock in ready:
                i = socks.index(sock)
                while True:
                    try:
                        data = sock.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    if len(data) >= _HEADER.size and data[:4] == _MAGIC:
                        _, r, _, t_send = _HEADER.unpack_from(data)
                        if r == run:
                            rtts[i].append((now - t_send) / 1000.0)

    try:
        next_at = time.monotonic()
        for seq in range(count):
            for i, (t, sock) in enumerate(zip(targets, socks, strict=True)):
                try:
                    sock.sendto(_HEADER.pack(_MAGIC, run, seq, time.monotonic_ns()) + pad, (t.dst_ip, t.port))
                    sent[i] += 1
                except OSError as exc:
                    errors[i] = errno.errorcode.get(exc.errno or 0, str(exc))
            next_at += interval_s
            drain(next_at)
        drain(time.monotonic() + 0.3)  # stragglers
    finally:
        for sock in socks:
            sock.close()
    out = []
    for i, t in enumerate(targets):
        r = sorted(rtts[i])
        out.append(
            {
                "src": t.src,
                "dst": t.dst,
                "sent": sent[i],
                "attempted": count,
                "replies": len(r),
                "rtt_p50_us": median(r) if r else None,
                "rtt_p99_us": r[min(len(r) - 1, int(0.99 * len(r)))] if r else None,
                "error": errors[i],
            }
        )
    return out


def _df_round_trip(t: Target, size: int, tries: int, timeout_s: float, run: int) -> tuple[int, str | None]:
    """How many of ``tries`` don't-fragment datagrams of ``size`` bytes (IP) came back echoed."""
    payload = size - 28  # IPv4 + UDP headers
    sock = _bound_socket(socket.SOCK_DGRAM, t.src_ip, t.device)
    sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
    sock.settimeout(timeout_s)
    got = 0
    try:
        for seq in range(tries):
            data = _HEADER.pack(_MAGIC, run, seq, time.monotonic_ns()).ljust(payload, b"\0")
            try:
                sock.sendto(data, (t.dst_ip, t.port))
            except OSError as exc:
                return got, errno.errorcode.get(exc.errno or 0, str(exc))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    reply = sock.recv(65536)
                except (TimeoutError, BlockingIOError):
                    break
                if len(reply) == len(data) and reply[:12] == data[:12]:
                    got += 1
                    break
    finally:
        sock.close()
    return got, None


def mtu_check(targets: list[Target], mtu: int, tries: int, run: int) -> list[dict[str, Any]]:
    """Do full-size (``mtu``) frames cross each path both ways? If not, the largest size that does."""
    out = []
    for t in targets:
        small, _ = _df_round_trip(t, 128, tries, 0.2, run)
        full, error = _df_round_trip(t, mtu, tries, 0.2, run)
        largest = mtu if full else None
        if small and not full and error is None:
            lo, hi = 128, mtu  # lo passes, hi fails
            while hi - lo > 8:
                mid = (lo + hi) // 2
                ok, _ = _df_round_trip(t, mid, 2, 0.1, run)
                lo, hi = (mid, hi) if ok else (lo, mid)
            largest = lo
        out.append(
            {
                "src": t.src,
                "dst": t.dst,
                "mtu": mtu,
                "small_ok": small > 0,
                "full_ok": full > 0,
                "largest_ok": largest,
                "error": error,
            }
        )
    return out


class Sink:
    """TCP sinks on each NIC address: read a transfer to its end, answer with the byte count and time."""

    def __init__(self, bindings: list[tuple[str, str | None]]) -> None:
        self.socks = {ip: _bound_socket(socket.SOCK_STREAM, ip, dev) for ip, dev in bindings}
        for sock in self.socks.values():
            sock.listen(8)
        self._threads = [
            threading.Thread(target=self._accept, args=(sock,), name="audit-sink", daemon=True)
            for sock in self.socks.values()
        ]
        for thread in self._threads:
            thread.start()

    def ports(self) -> dict[str, int]:
        return {ip: sock.getsockname()[1] for ip, sock in self.socks.items()}

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        total, first = 0, None
        buf = bytearray(_CHUNK)
        with conn:
            conn.settimeout(30)
            try:
                while True:
                    n = conn.recv_into(buf)
                    if n == 0:
                        break
                    if first is None:
                        first = time.monotonic()
                    total += n
                elapsed = time.monotonic() - first if first is not None else 0.0
                conn.sendall(struct.pack("!Qd", total, elapsed))
            except OSError:
                return

    def close(self) -> None:
        for sock in self.socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(); close() alone does not
            except OSError:
                pass
            sock.close()
        for thread in self._threads:
            thread.join(timeout=2)


def transfer(t: Target, seconds: float) -> dict[str, Any]:
    """Push bytes from this NIC to a peer's sink for ``seconds``; throughput as the receiver counted it."""
    result: dict[str, Any] = {"src": t.src, "dst": t.dst, "seconds": seconds}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, t.device.encode())
        sock.bind((t.src_ip, 0))
        sock.settimeout(max(5.0, 4 * seconds))
        sock.connect((t.dst_ip, t.port))
        chunk = b"\0" * _CHUNK
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < 16:
            part = sock.recv(16 - len(reply))
            if not part:
                break
            reply += part
        if len(reply) < 16:
            result["error"] = "the receiver closed without a count"
            return result
        received, elapsed = struct.unpack("!Qd", reply)
        result.update(bytes=received, elapsed_s=elapsed, gbps=received * 8 / elapsed / 1e9 if elapsed > 0 else None)
    except OSError as exc:
        result["error"] = str(exc) or type(exc).__name__
    finally:
        sock.close()
    return result
