"""ICMP echo to a peer's kernel on each rail: does the node still answer, whatever its processes do?

A node whose daemon and training processes are stopped (SIGSTOP), starved or swapped out still answers an
echo from its kernel within microseconds; a crashed, powered-off or cut-off node does not. That is the
difference between a starved node and a dead one, which the daemons' own heartbeats cannot tell.

One raw ICMP socket per rail (root: the daemon's), bound to this node's address on that rail and to the
rail's device, so each echo leaves and each answer returns on the rail probed. Echoes carry this daemon's
identifier; everything else arriving on the raw sockets (the kernel's own answers to others, other pings) is
skipped. Nothing here blocks: sends that fail are counted, answers are read when the node watch ticks.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

__all__ = ["EchoProber", "checksum", "echo_request", "parse_echo_reply"]

log = logging.getLogger("clockwork.nodewatch")

SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
ICMP_ECHO_REPLY, ICMP_ECHO_REQUEST = 0, 8
PAYLOAD = b"clockwork-nodewatch"


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int) -> bytes:
    """An ICMP echo request (header and payload, without the IP header: the kernel adds it)."""
    header = struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, 0, ident, seq & 0xFFFF)
    return struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, checksum(header + PAYLOAD), ident, seq & 0xFFFF) + PAYLOAD


def parse_echo_reply(packet: bytes, ident: int) -> bool:
    """Whether ``packet`` (as a raw IPv4 socket returns it: IP header first) is an echo reply to ``ident``."""
    if len(packet) < 20:
        return False
    start = (packet[0] & 0x0F) * 4
    if len(packet) < start + 8:
        return False
    kind, _code, _sum, got = struct.unpack("!BBHH", packet[start : start + 6])
    return kind == ICMP_ECHO_REPLY and got == ident


class EchoProber:
    """Echo requests to peers' rail addresses and the answers to them, one raw socket per rail."""

    def __init__(self, own: dict[str, str]) -> None:
        self.own = dict(own)  # rail -> this node's address on it
        self.ident = os.getpid() & 0xFFFF
        self.seq = 0
        self.sockets: dict[str, socket.socket] = {}
        self.counters = {"sent": 0, "answers": 0, "send_errors": 0}

    def open(self) -> None:
        """One socket per rail; OSError (e.g. no CAP_NET_RAW) when the echo cannot be sent at all."""
        try:
            for rail, address in self.own.items():
                sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
                self.sockets[rail] = sock
                sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, rail.encode())
                sock.bind((address, 0))
                sock.setblocking(False)
        except OSError:
            self.close()
            raise

    def send(self, rail: str, address: str) -> None:
        """One echo to ``address`` (a peer's address on ``rail``)."""
        sock = self.sockets.get(rail)
        if sock is None:
            return
        self.seq += 1
        try:
            sock.sendto(echo_request(self.ident, self.seq), (address, 0))
            self.counters["sent"] += 1
        except OSError:  # the NIC is down, no neighbour yet, ...: the answer's absence says the same
            self.counters["send_errors"] += 1

    def answers(self) -> list[tuple[str, str]]:
        """(rail, source address) of every echo answer to us received since the last call."""
        out: list[tuple[str, str]] = []
        for rail, sock in self.sockets.items():
            while True:
                try:
                    packet, (source, _port) = sock.recvfrom(2048)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log.debug("echo socket on %s: %s", rail, exc)
                    break
                if parse_echo_reply(packet, self.ident):
                    self.counters["answers"] += 1
                    out.append((rail, source))
        return out

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
