"""Batched UDP I/O with kernel receive timestamps: the probe sockets, and the C extension that uses them.

Why: a node probes 16 peers from each NIC every 10 ms, thousands of packets a second. A Python
``sendto``/``recvmsg`` per packet costs ~10 µs of CPU each (interpreter + syscall), which alone
would spend the whole probing budget (< 3 % of a core). Probes and trains go through
``clockworkd.lens._probeio`` (C; :func:`probeio`): its ``Pacer`` thread sends one ``sendmmsg`` per NIC
per tick with every header built and tagged in C, without the GIL, and one call per drain reads
(``recvmmsg``), authenticates and parses everything waiting into int64 records (RECORD_FIELDS per
packet) numpy files in one go. Reads can be lazy (every 50 ms, not per packet) because the kernel
stamps each packet when it arrives (SO_TIMESTAMPNS), not when it is read. :class:`Sender` (ctypes
``sendmmsg``) sends the summaries (a few a second); :class:`Receiver` is the ctypes reader the tests
use as a reference.

Linux x86-64/arm64 only (struct layouts below are the LP64 ones).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import socket
import struct
from types import ModuleType

import numpy as np

SO_TIMESTAMPNS = 35  # SO_TIMESTAMPNS_OLD: Python's socket module lacks the constant
SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # Linux; root may exceed the sysctl limits with these
MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20
SLOT = 8192  # largest datagram read whole; longer ones are flagged truncated and dropped
CONTROL = 64  # room for one cmsghdr + struct timespec
BATCH = 64
KEY_SLOTS = 4  # keys per node in a key table (the C code's KEY_SLOTS; a build without them is stale)
RECORD_FIELDS = 12  # int64 fields of one record the C receiver (_probeio.drain) fills; names below
RECORDS = 64 * 64 + 64  # records one drain can fill (64 recvmmsg batches of 64)
# The fields of a record, in csrc/records.h's order (the C drain fills them): R_PATH is the index of the
# receiving node's incoming path the packet came on, R_RX its kernel arrival stamp, R_LENGTH its size in bytes,
# the others its header's fields.
R_PATH, R_KIND, R_FLAGS, R_SEQ, R_TX, R_RX, R_SESSION, R_AUX, R_ECHO_SEQ, R_HOLD, R_LENGTH, R_SRC_NODE = range(
    RECORD_FIELDS
)


class ProbeIOMissing(RuntimeError):
    """The C extension Lens probes with is not built (no pure-Python fallback: it would cost ~6 % of a core)."""


_probeio: ModuleType | None = None


def probeio() -> ModuleType:
    """``clockworkd.lens._probeio``, the C extension that builds, tags, sends, receives and parses probes.

    Why no fallback: the same work in Python costs ~6 % of a core per node at a 10 ms interval with 16
    peers per NIC (the goal is < 3 % in all), so a missing build must stop Lens loudly, not slow it.
    """
    global _probeio
    if _probeio is None:
        try:
            _probeio = importlib.import_module("clockworkd.lens._probeio")
        except ImportError as exc:
            raise ProbeIOMissing(
                f"Fleet Lens's C extension clockworkd.lens._probeio is not built ({exc}); build it with "
                "`make venv` or `pip install -e .` (needs gcc and the Python headers)"
            ) from exc
        if _probeio.RECORD_FIELDS != RECORD_FIELDS:
            found, _probeio = _probeio.RECORD_FIELDS, None
            raise ProbeIOMissing(f"clockworkd.lens._probeio is stale ({found} record fields): rebuild it (make venv)")
        if getattr(_probeio, "KEY_SLOTS", None) != KEY_SLOTS:  # built before pairwise keys: takes one key only
            _probeio = None
            raise ProbeIOMissing("clockworkd.lens._probeio is stale (no pairwise key tables): rebuild it (make venv)")
    return _probeio


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.POINTER(_IoVec)),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint)]


assert ctypes.sizeof(_MMsgHdr) == 64, "fastio supports LP64 Linux only"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_sendmmsg = _libc.sendmmsg
_sendmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MMsgHdr), ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MMsgHdr), ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int


def sockaddr_in(ip: str, port: int) -> bytes:
    """A ``struct sockaddr_in`` (16 bytes) for ``ip:port``."""
    return struct.pack("=HH4s8x", socket.AF_INET, socket.htons(port), socket.inet_aton(ip))


def _set_buffer(sock: socket.socket, forced: int, plain: int, size: int) -> None:
    """A socket buffer of ``size``: past ``net.core.rmem_max``/``wmem_max`` as root (the daemon), within
    them otherwise. Linux's default limit (~208 KiB) is about two 50 ms reads' worth at 16 peers per NIC (~80
    datagrams of ~1 KiB of kernel memory each): little to spare for a burst of train packets or a late read."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, forced, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, plain, size)


def open_socket(ip: str, port: int, device: str, rcvbuf: int = 4 << 20) -> socket.socket:
    """A non-blocking UDP socket bound to ``ip:port`` on ``device``, stamping arrivals (SO_TIMESTAMPNS)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, device.encode())
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        _set_buffer(sock, SO_RCVBUFFORCE, socket.SO_RCVBUF, rcvbuf)
        _set_buffer(sock, SO_SNDBUFFORCE, socket.SO_SNDBUF, rcvbuf)
        sock.bind((ip, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class Receiver:
    """Drains one socket in batches: payload bytes, receive timestamps (ns) and source addresses."""

    def __init__(self, batch: int = BATCH) -> None:
        self.batch = batch
        self._payload = ctypes.create_string_buffer(batch * SLOT)
        self._control = ctypes.create_string_buffer(batch * CONTROL)
        self._names = ctypes.create_string_buffer(batch * 16)
        self._iov = (_IoVec * batch)()
        self._hdrs = (_MMsgHdr * batch)()
        base_p = ctypes.addressof(self._payload)
        base_c = ctypes.addressof(self._control)
        base_n = ctypes.addressof(self._names)
        for i in range(batch):
            self._iov[i].iov_base = base_p + i * SLOT
            self._iov[i].iov_len = SLOT
            h = self._hdrs[i].msg_hdr
            h.msg_name = base_n + i * 16
            h.msg_iov = ctypes.pointer(self._iov[i])
            h.msg_iovlen = 1
            h.msg_control = base_c + i * CONTROL
        # numpy views over the same memory: reset lengths and read results without a Python loop.
        # (Through byte memoryviews: numpy's stubs do not take ctypes arrays as buffers; same memory.)
        hdr_bytes = memoryview(self._hdrs).cast("B")
        self._hdr_words = np.frombuffer(hdr_bytes, dtype=np.uint64).reshape(batch, 8)
        self._hdr_u32 = np.frombuffer(hdr_bytes, dtype=np.uint32).reshape(batch, 16)
        self._ctl = np.frombuffer(memoryview(self._control).cast("B"), dtype=np.int64).reshape(batch, CONTROL // 8)
        self._names_u32 = np.frombuffer(memoryview(self._names).cast("B"), dtype=np.uint32).reshape(batch, 4)
        self.payload = memoryview(self._payload).cast("B")

    def recv(self, fd: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Read up to ``batch`` datagrams now (never blocks).

        Returns ``(n, lengths, rx_ns, src_ip_u32, truncated)``; datagram ``i`` is
        ``self.payload[i*SLOT : i*SLOT + lengths[i]]``. ``rx_ns`` is 0 where the kernel gave no stamp.
        """
        self._hdr_u32[:, 2] = 16  # msg_namelen
        self._hdr_words[:, 5] = CONTROL  # msg_controllen
        n = _recvmmsg(fd, self._hdrs, self.batch, MSG_DONTWAIT, None)
        if n <= 0:
            err = ctypes.get_errno()
            if n < 0 and err not in (0, 11):  # EAGAIN is the normal end of a drain
                raise OSError(err, os.strerror(err))
            empty = np.zeros(0, dtype=np.int64)
            return 0, empty, empty, empty.astype(np.uint32), empty.astype(bool)
        lengths = self._hdr_u32[:n, 14].astype(np.int64)  # msg_len
        flags = self._hdr_u32[:n, 12]  # msg_flags
        ctl = self._ctl[:n]
        # One cmsghdr {len, level, type} then struct timespec: level/type share the second word.
        level_type = ctl[:, 1]
        stamped = (level_type & 0xFFFFFFFF == socket.SOL_SOCKET) & ((level_type >> 32) == SO_TIMESTAMPNS)
        stamped &= self._hdr_words[:n, 5] >= 32
        rx_ns = np.where(stamped, ctl[:, 2] * 1_000_000_000 + ctl[:, 3], 0)
        src = self._names_u32[:n, 1].copy()  # sin_addr in network order, as stored
        truncated = (flags & MSG_TRUNC) != 0
        return n, lengths, rx_ns, src, truncated


class Sender:
    """Sends a list of (payload, sockaddr) in one ``sendmmsg`` (retrying the rest if the kernel stops early).

    Payloads and addresses are copied into preallocated slots, and the lengths set through a numpy view
    of the iovec array: no ctypes object per message (those cost more than the send itself).
    """

    def __init__(self, batch: int = 128, slot: int = 16384) -> None:
        self.batch = batch
        self.slot = slot
        self._data = ctypes.create_string_buffer(batch * slot)
        self._names = ctypes.create_string_buffer(batch * 16)
        self._iov = (_IoVec * batch)()
        self._hdrs = (_MMsgHdr * batch)()
        base_d, base_n = ctypes.addressof(self._data), ctypes.addressof(self._names)
        for i in range(batch):
            self._iov[i].iov_base = base_d + i * slot
            h = self._hdrs[i].msg_hdr
            h.msg_iov = ctypes.pointer(self._iov[i])
            h.msg_iovlen = 1
            h.msg_name = base_n + i * 16
            h.msg_namelen = 16
        self._data_mv = memoryview(self._data).cast("B")
        self._names_mv = memoryview(self._names).cast("B")
        self._iov_len = np.frombuffer(memoryview(self._iov).cast("B"), dtype=np.uint64).reshape(batch, 2)[:, 1]

    def send(self, fd: int, messages: list[tuple[bytes, bytes]]) -> tuple[int, int]:
        """Send every message; returns (sent, errno of the first failure or 0). Never blocks."""
        sent = 0
        data, names, slot = self._data_mv, self._names_mv, self.slot
        for start in range(0, len(messages), self.batch):
            chunk = messages[start : start + self.batch]
            lengths = []
            for i, (payload, addr) in enumerate(chunk):
                size = len(payload)
                if size > slot:
                    raise ValueError(f"datagram of {size} bytes exceeds the send slot ({slot})")
                data[i * slot : i * slot + size] = payload
                names[i * 16 : i * 16 + 16] = addr
                lengths.append(size)
            self._iov_len[: len(chunk)] = lengths
            done = 0
            while done < len(chunk):
                n = _sendmmsg(fd, ctypes.byref(self._hdrs[done]), len(chunk) - done, MSG_DONTWAIT)
                if n <= 0:
                    return sent + done, ctypes.get_errno() or 11
                done += n
            sent += done
        return sent, 0
