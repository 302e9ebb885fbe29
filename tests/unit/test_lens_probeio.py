"""Fleet Lens's C extension (clockworkd.lens._probeio) against wire.py, the Python reference of the format.

Real UDP over loopback with kernel receive stamps: what the C sender puts on the wire must be what
wire.py builds byte for byte, and what the C receiver keeps, rejects and parses must be what the
Python checks did (authentic, addressed to this NIC, from the NIC the packet names, on a watched path).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from clockworkd.lens import fastio, wire
from clockworkd.lens.prober import (
    ECHO_RING,
    R_AUX,
    R_ECHO_SEQ,
    R_FLAGS,
    R_HOLD,
    R_KIND,
    R_LENGTH,
    R_PATH,
    R_RX,
    R_SEQ,
    R_SESSION,
    R_SRC_NODE,
    R_TX,
)

KEY = b"k" * 32
SESSION = 0xDEADBEEF
ME = (1, 0)  # (node index, NIC index) of the receiving NIC in these tests
PEER = (2, 0)  # the sender
LOCAL = "127.0.0.1"


def probeio():  # type: ignore[no-untyped-def]
    return fastio.probeio()


@pytest.fixture
def rx_socket() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, fastio.SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((LOCAL, 0))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def _recv_raw(sock: socket.socket, want: int) -> list[bytes]:
    got: list[bytes] = []
    end = time.monotonic() + 2.0
    while len(got) < want and time.monotonic() < end:
        try:
            got.append(sock.recv(65536))
        except BlockingIOError:
            time.sleep(0.001)
    return got


def _ip_u32(ip: str) -> int:
    return int(np.frombuffer(socket.inet_aton(ip), dtype=np.uint32)[0])


def _tables(sender_ip: str = LOCAL, watched: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """nic_ip (3 nodes x 1 NIC) and path_of for a receiver at ME watching PEER's probes as path 0."""
    nic_ip = np.zeros((3, 1), dtype=np.uint32)
    nic_ip[PEER[0], PEER[1]] = _ip_u32(sender_ip)
    nic_ip[ME[0], ME[1]] = _ip_u32("127.0.0.9")
    path_of = np.full(3, -1, dtype=np.int64)
    if watched:
        path_of[PEER[0] * 1 + PEER[1]] = 0
    return nic_ip, path_of


def _drain(sock: socket.socket, want: int, tables: tuple[np.ndarray, np.ndarray] | None = None) -> tuple:
    nic_ip, path_of = tables or _tables()
    out = np.zeros((fastio.RECORDS, fastio.RECORD_FIELDS), dtype=np.int64)
    n_all, rejected_all, summaries_all, rows = 0, 0, [], []
    end = time.monotonic() + 2.0
    while n_all + rejected_all + len(summaries_all) < want and time.monotonic() < end:
        n, rejected, summaries = probeio().drain(sock.fileno(), KEY, ME[0], ME[1], nic_ip, 1, path_of, out, 64)
        rows.extend(out[:n].copy())
        n_all, rejected_all = n_all + n, rejected_all + rejected
        summaries_all += summaries
        if not (n or rejected or summaries):
            time.sleep(0.001)
    return np.array(rows, dtype=np.int64).reshape(-1, fastio.RECORD_FIELDS), rejected_all, summaries_all


# ----- the tag ----------------------------------------------------------------------------------


@pytest.mark.parametrize("keylen", [1, 16, 32, 64])
def test_tag_is_keyed_blake2b_64(keylen: int) -> None:
    rng = np.random.default_rng(keylen)
    key = rng.bytes(keylen)
    for size in (1, 40, 127, 128, 129, 255, 256, 257, 1400, 7040):
        data = rng.bytes(size)
        assert probeio().tag(key, data) == hashlib.blake2b(data, key=key, digest_size=8).digest(), size
        assert probeio().tag(key, data) == wire.tag(key, data)


def test_tag_refuses_what_hashlib_would_not_compute_the_same() -> None:
    with pytest.raises(ValueError):
        probeio().tag(b"", b"x")
    with pytest.raises(ValueError):
        probeio().tag(b"k" * 65, b"x")
    with pytest.raises(ValueError):
        probeio().tag(KEY, b"")


# ----- sending ----------------------------------------------------------------------------------


def _send_probes(tx: socket.socket, port: int, paths: int, pair: int, tx_ns: int, echo: tuple[int, int] | None) -> dict:
    addr = fastio.sockaddr_in(LOCAL, port)
    state = {
        "seq": np.array([10 * (k + 1) for k in range(paths)], dtype=np.int64),
        "dst_node": np.array([ME[0]] * paths, dtype=np.int64),
        "dst_nic": np.array([ME[1]] * paths, dtype=np.int64),
        "ring_seq": np.full((paths, ECHO_RING), -1, dtype=np.int64),
        "ring_tx": np.zeros((paths, ECHO_RING), dtype=np.int64),
        "rev": np.array([0] + [-1] * (paths - 1), dtype=np.int64),
        "echo_seq": np.array([echo[0] if echo else -1], dtype=np.int64),
        "echo_rx": np.array([echo[1] if echo else 0], dtype=np.int64),
    }
    sent, err = probeio().send_probes(
        tx.fileno(), KEY, PEER[0], PEER[1], SESSION, tx_ns, pair, state["seq"], state["dst_node"],
        state["dst_nic"], addr * paths, state["ring_seq"], state["ring_tx"], state["rev"],
        state["echo_seq"], state["echo_rx"],
    )  # fmt: skip
    state["sent"], state["err"] = sent, err
    return state


def test_probes_are_what_wire_builds_pair_first(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    port = rx_socket.getsockname()[1]
    tx_ns = 1_800_000_000_123_456_789
    echo_rx = tx_ns - 250_000  # the reverse path's newest probe arrived 250 µs before this send
    state = _send_probes(tx_socket, port, paths=3, pair=1, tx_ns=tx_ns, echo=(77, echo_rx))
    assert (state["sent"], state["err"]) == (4, 0)
    got = _recv_raw(rx_socket, 4)
    expected = [
        wire.sign(KEY, wire.header(wire.PROBE, wire.PAIR_FIRST, PEER, ME, 21, tx_ns, SESSION, 0, 0, wire.NO_ECHO)),
        wire.sign(KEY, wire.header(wire.PROBE, wire.PAIR_SECOND, PEER, ME, 22, tx_ns, SESSION, 0, 0, wire.NO_ECHO)),
        wire.sign(KEY, wire.header(wire.PROBE, 0, PEER, ME, 11, tx_ns, SESSION, 0, 77, 250_000)),  # path 0 echoes
        wire.sign(KEY, wire.header(wire.PROBE, 0, PEER, ME, 31, tx_ns, SESSION, 0, 0, wire.NO_ECHO)),
    ]
    assert got == expected
    assert state["seq"].tolist() == [11, 22, 31]
    # every probe's transmit time is kept for the echo that will come back for it
    for k, seqs in ((0, [11]), (1, [21, 22]), (2, [31])):
        for q in seqs:
            assert state["ring_seq"][k, q % ECHO_RING] == q
            assert state["ring_tx"][k, q % ECHO_RING] == tx_ns


def test_no_pair_and_stale_echo(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    port = rx_socket.getsockname()[1]
    tx_ns = 10**18
    state = _send_probes(tx_socket, port, paths=2, pair=-1, tx_ns=tx_ns, echo=(5, tx_ns + 1))  # arrived "later"
    assert state["sent"] == 2
    heads = [wire.HEADER.unpack(p[: wire.HEADER_BYTES]) for p in _recv_raw(rx_socket, 2)]
    assert [h[7] for h in heads] == [11, 21]
    assert all(h[2] == 0 for h in heads)  # no pair flags
    assert all((h[11], h[12]) == (0, wire.NO_ECHO) for h in heads)  # a negative hold is no echo


def test_train_packets_are_what_wire_builds(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    port = rx_socket.getsockname()[1]
    addr = fastio.sockaddr_in(LOCAL, port)
    tx_ns = 1_700_000_000_000_000_000
    sent = probeio().send_train(
        tx_socket.fileno(), KEY, PEER[0], PEER[1], ME[0], ME[1], addr, 9, tx_ns, SESSION, 3, 4, 47, wire.TRAIN_PACKET
    )
    assert sent == (4, 0)
    got = _recv_raw(rx_socket, 4)
    expected = [
        wire.sign(KEY, wire.header(wire.TRAIN, 0, PEER, ME, 9, tx_ns, SESSION, (i << 16) | 47), pad_to=1400)
        for i in range(3, 7)
    ]
    assert got == expected
    with pytest.raises(ValueError):
        probeio().send_train(tx_socket.fileno(), KEY, 0, 0, 0, 0, addr, 1, 0, 0, 40, 10, 47, 1400)  # beyond total


def test_send_errors_are_returned_not_raised(tx_socket: socket.socket) -> None:
    fd = os.dup(tx_socket.fileno())
    os.close(fd)
    addr = fastio.sockaddr_in(LOCAL, 9)
    sent, err = probeio().send_train(fd, KEY, 0, 0, 0, 0, addr, 1, 0, 0, 0, 2, 2, 1400)
    assert sent == 0 and err != 0


# ----- receiving --------------------------------------------------------------------------------


def test_drain_parses_authentic_probes_and_trains(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    port = rx_socket.getsockname()[1]
    dest = (LOCAL, port)
    probe = wire.sign(KEY, wire.header(wire.PROBE, wire.PAIR_SECOND, PEER, ME, 0xFFFFFFF0, -5, SESSION, 0, 12, 3456))
    train = wire.sign(KEY, wire.header(wire.TRAIN, 0, PEER, ME, 4, 99, SESSION, (2 << 16) | 47), pad_to=1400)
    before = time.time_ns()
    tx_socket.sendto(probe, dest)
    tx_socket.sendto(train, dest)
    rows, rejected, summaries = _drain(rx_socket, 2)
    assert rejected == 0 and summaries == []
    assert len(rows) == 2
    p, t = rows
    assert p[R_PATH] == 0 and p[R_KIND] == wire.PROBE and p[R_FLAGS] == wire.PAIR_SECOND
    assert (p[R_SEQ], p[R_TX], p[R_SESSION], p[R_ECHO_SEQ], p[R_HOLD]) == (0xFFFFFFF0, -5, SESSION, 12, 3456)
    assert p[R_LENGTH] == wire.PROBE_BYTES and p[R_SRC_NODE] == PEER[0]
    assert before - 1_000_000_000 < p[R_RX] < time.time_ns() + 1_000_000_000  # the kernel's arrival stamp
    assert t[R_KIND] == wire.TRAIN and t[R_AUX] == (2 << 16) | 47 and t[R_LENGTH] == 1400 and t[R_SEQ] == 4


def test_drain_rejects_forged_misaddressed_and_spoofed(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    dest = (LOCAL, rx_socket.getsockname()[1])
    good = wire.header(wire.PROBE, 0, PEER, ME, 1, 0, SESSION)
    forged = bytearray(wire.sign(KEY, good))
    forged[-1] ^= 1
    packets = [
        bytes(forged),  # bad tag
        wire.sign(b"x" * 32, good),  # another key
        wire.sign(KEY, wire.header(wire.PROBE, 0, PEER, (ME[0], 1), 1, 0, SESSION)),  # another NIC of this node
        wire.sign(KEY, wire.header(wire.PROBE, 0, PEER, (0, 0), 1, 0, SESSION)),  # another node
        wire.sign(KEY, wire.header(wire.PROBE, 0, (7, 0), ME, 1, 0, SESSION)),  # a node that does not exist
        wire.sign(KEY, wire.header(wire.PROBE, 0, (0, 0), ME, 1, 0, SESSION)),  # claims a NIC it is not sent from
        wire.sign(KEY, good)[:-1],  # short
        b"CWL0" + wire.sign(KEY, good)[4:],  # wrong magic
    ]
    for p in packets:
        tx_socket.sendto(p, dest)
    rows, rejected, summaries = _drain(rx_socket, len(packets))
    assert (len(rows), rejected, summaries) == (0, len(packets), [])


def test_drain_skips_unwatched_paths_and_returns_summaries(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    dest = (LOCAL, rx_socket.getsockname()[1])
    body = wire.summary_body({"n": "n2", "v": [], "e": [], "c": []})
    summary = wire.sign(KEY, wire.header(wire.SUMMARY, 0, PEER, ME, 3, 0, SESSION, len(body)), body)
    probe = wire.sign(KEY, wire.header(wire.PROBE, 0, PEER, ME, 1, 0, SESSION))
    tx_socket.sendto(summary, dest)
    tx_socket.sendto(probe, dest)
    cut = bytearray(summary)
    cut[28:32] = (len(body) + 100).to_bytes(4, "little")  # claims a longer body than the datagram holds
    tx_socket.sendto(bytes(cut), dest)
    time.sleep(0.05)
    rows, rejected, summaries = _drain(rx_socket, 2, _tables(watched=False))
    assert len(rows) == 0  # authentic, but no path this node watches
    assert summaries == [summary]
    assert rejected == 1


def test_drain_rejects_truncated_datagrams(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    dest = (LOCAL, rx_socket.getsockname()[1])
    big = wire.sign(KEY, wire.header(wire.TRAIN, 0, PEER, ME, 1, 0, SESSION, (0 << 16) | 2), pad_to=9000)
    tx_socket.sendto(big, dest)
    rows, rejected, _ = _drain(rx_socket, 1)
    assert (len(rows), rejected) == (0, 1)


def test_drain_reads_more_than_one_batch(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    dest = (LOCAL, rx_socket.getsockname()[1])
    count = 3 * probeio().RECV_BATCH + 5
    for q in range(count):
        tx_socket.sendto(wire.sign(KEY, wire.header(wire.PROBE, 0, PEER, ME, q, q, SESSION)), dest)
    rows, rejected, _ = _drain(rx_socket, count)
    assert rejected == 0
    assert rows[:, R_SEQ].tolist() == list(range(count))  # arrival order kept


def test_a_missing_build_stops_lens_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """No silent pure-Python fallback: Lens's start fails naming the fix (the daemon logs it as an error)."""

    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(fastio, "_probeio", None)
    monkeypatch.setattr(fastio.importlib, "import_module", missing)
    with pytest.raises(fastio.ProbeIOMissing, match="make venv"):
        fastio.probeio()


def test_more_paths_than_one_send_batch(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    """A NIC may probe more peers than one sendmmsg batch holds (peers_per_nic has no upper bound)."""
    state = _send_probes(tx_socket, rx_socket.getsockname()[1], paths=200, pair=150, tx_ns=10**18, echo=None)
    assert (state["sent"], state["err"]) == (201, 0)
    heads = [wire.HEADER.unpack(p[: wire.HEADER_BYTES]) for p in _recv_raw(rx_socket, 201)]
    assert len(heads) == 201
    assert [h[2] for h in heads[:2]] == [wire.PAIR_FIRST, wire.PAIR_SECOND]
    assert sorted(h[7] for h in heads[2:]) == sorted(10 * (k + 1) + 1 for k in range(200) if k != 150)
