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

from clockworkd.lens import clockseam, fastio, wire
from clockworkd.lens.fastio import (
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
from clockworkd.lens.probepaths import ECHO_RING

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
    # _drain reads until it has the summary and the rejected cut one; the probe between them (sent on the same
    # loopback socket pair, which keeps the order) has been read by then
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


# ----- the pacer thread -------------------------------------------------------------------------


class _Paced:
    """A pacer probing ``paths`` paths from ``tx`` to ``rx`` (every path to the same socket; path k names
    NIC k of the receiving node, so that each packet says which path it went on)."""

    def __init__(self, tx: socket.socket, rx: socket.socket, paths: int, interval_ms: float, **kw: object) -> None:
        self.paths = paths
        self.seq = np.zeros(paths, dtype=np.int64)
        self.ring_seq = np.full((paths, ECHO_RING), -1, dtype=np.int64)
        self.ring_tx = np.zeros((paths, ECHO_RING), dtype=np.int64)
        self.echo_seq = np.full(1, -1, dtype=np.int64)
        self.echo_rx = np.zeros(1, dtype=np.int64)
        self.pacer = probeio().Pacer(
            KEY, PEER[0], SESSION, round(interval_ms * 1e6), kw.pop("pair_every", 1), self.echo_seq, self.echo_rx,
            kw.pop("seam", None),
        )  # fmt: skip
        self.pacer.add_nic(
            tx.fileno(), PEER[1], self.seq, np.full(paths, ME[0], dtype=np.int64), np.arange(paths, dtype=np.int64),
            fastio.sockaddr_in(LOCAL, rx.getsockname()[1]) * paths, self.ring_seq, self.ring_tx,
            np.array([0] + [-1] * (paths - 1), dtype=np.int64),
        )  # fmt: skip

    def run(self, ticks: int) -> dict:
        """Start, wait until ``ticks`` ticks have run, stop; the pacer's stats."""
        self.pacer.start()
        while self.pacer.stats()["ticks"] < ticks:
            time.sleep(0.005)
        self.pacer.stop()
        return self.pacer.stats()


def _headers(sock: socket.socket, want: int) -> list[tuple]:
    packets = _recv_raw(sock, want)
    for p in packets:  # every one authentic: what wire.py signs
        assert wire.sign(KEY, p[: wire.HEADER_BYTES]) == p
    return [wire.HEADER.unpack(p[: wire.HEADER_BYTES]) for p in packets]


def test_pacer_sends_a_batch_per_tick_with_the_pair_taking_turns(
    rx_socket: socket.socket, tx_socket: socket.socket
) -> None:
    paced = _Paced(tx_socket, rx_socket, paths=3, interval_ms=5)
    stats = paced.run(ticks=6)
    ticks = stats["ticks"]
    assert stats["sent"] == ticks * 4 and stats["errors"] == 0  # 3 paths, one of them a pair
    heads = _headers(rx_socket, stats["sent"])
    assert len(heads) == stats["sent"] and not _recv_raw(rx_socket, 1)  # nothing after stop()
    stamps = sorted({h[8] for h in heads})
    assert len(stamps) == ticks  # one transmit stamp per tick
    for t, stamp in enumerate(stamps):
        batch = [h for h in heads if h[8] == stamp]
        assert [h[2] for h in batch] == [wire.PAIR_FIRST, wire.PAIR_SECOND, 0, 0]
        assert batch[0][5] == batch[1][5] == t % 3  # the paths take turns at the pair, which goes first
        assert batch[0][7] + 1 == batch[1][7]  # its two sequence numbers follow each other
        assert sorted(h[5] for h in batch[2:]) == [k for k in range(3) if k != t % 3]
        assert all(h[9] == SESSION and (h[3], h[4]) == PEER and h[6] == ME[0] for h in batch)
    for k in range(3):  # each path's sequence numbers count its probes, and its ring holds their transmit times
        assert [h[7] for h in heads if h[5] == k] == list(range(1, int(paced.seq[k]) + 1))
        last = int(paced.seq[k])
        assert paced.ring_seq[k, last % ECHO_RING] == last and paced.ring_tx[k, last % ECHO_RING] == stamps[-1]


def test_pacer_stamps_through_the_clock_seam(rx_socket: socket.socket, tx_socket: socket.socket) -> None:
    offset_ns = 10_000_000_000  # 10 s ahead of the real clock, no drift
    stats = _Paced(tx_socket, rx_socket, paths=1, interval_ms=5, seam=(offset_ns, 0.0, 0)).run(ticks=3)
    rows, rejected, _ = _drain(rx_socket, stats["sent"])
    assert (len(rows), rejected) == (stats["sent"], 0)
    ahead = rows[:, R_TX] - rows[:, R_RX]  # seam clock at send minus the kernel's real arrival stamp
    assert np.all((ahead > offset_ns - 1_000_000_000) & (ahead <= offset_ns)), ahead


def test_pacer_lock_holds_the_ticks_and_echoes_written_under_it_go_out(
    rx_socket: socket.socket, tx_socket: socket.socket
) -> None:
    paced = _Paced(tx_socket, rx_socket, paths=2, interval_ms=5, pair_every=0)
    paced.pacer.start()
    try:
        while paced.pacer.stats()["ticks"] < 2:
            time.sleep(0.005)
        with paced.pacer:
            held = paced.pacer.stats()["ticks"]
            time.sleep(0.05)  # ten intervals
            assert paced.pacer.stats()["ticks"] == held  # no tick while Python holds the lock
            paced.echo_seq[0] = 77
            paced.echo_rx[0] = time.time_ns()
        while paced.pacer.stats()["ticks"] < held + 2:
            time.sleep(0.005)
    finally:
        paced.pacer.stop()
    stats = paced.pacer.stats()
    assert stats["late"] >= 1  # the held-up ticks were skipped, not sent in a burst
    heads = _headers(rx_socket, stats["sent"])
    echoed = [h for h in heads if h[11] == 77]
    assert echoed and all(h[12] != wire.NO_ECHO and h[12] == h[8] - paced.echo_rx[0] for h in echoed)
    assert all(h[2] == 0 for h in heads)  # pair_every 0: no coded pairs


def test_pacer_refuses_bad_arguments_and_late_nics(tx_socket: socket.socket, rx_socket: socket.socket) -> None:
    echo = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="interval_ns"):
        probeio().Pacer(KEY, 0, 0, 0, 1, echo, echo)
    with pytest.raises(ValueError, match="tag key"):
        probeio().Pacer(b"", 0, 0, 10_000_000, 1, echo, echo)
    with pytest.raises(TypeError, match="seam must be"):
        probeio().Pacer(KEY, 0, 0, 10_000_000, 1, echo, echo, (1, 2))
    paced = _Paced(tx_socket, rx_socket, paths=1, interval_ms=5)
    paced.pacer.start()
    with pytest.raises(RuntimeError, match="add NICs before start"):
        paced.pacer.add_nic(tx_socket.fileno(), 0, paced.seq, paced.seq, paced.seq, b"x" * 16, paced.ring_seq,
                            paced.ring_tx, paced.seq)  # fmt: skip
    paced.pacer.stop()
    paced.pacer.stop()  # idempotent
    running = _Paced(tx_socket, rx_socket, paths=1, interval_ms=5)
    running.pacer.start()
    del running  # freed while it runs: stopped and joined, its buffers released


def test_pacer_notes_the_newest_probe_of_each_path_for_its_echoes() -> None:
    """note_arrivals: per path, the newest probe of the path's known session becomes the echo (its arrival on
    this node's clock, through the seam); older probes, trains, other sessions and unknown paths change
    nothing, and probes of another session are counted (Python files a restarted sender itself)."""
    offset, drift, epoch = 5_000_000, 50.0, 1_000_000_000
    echo_seq = np.array([-1, 7, -1], dtype=np.int64)
    echo_rx = np.array([0, 70, 0], dtype=np.int64)
    pacer = probeio().Pacer(KEY, 0, SESSION, 10_000_000, 1, echo_seq, echo_rx, (offset, drift, epoch))
    in_session = np.array([SESSION, SESSION, 4], dtype=np.int64)

    def record(path: int, seq: int, rx: int, kind: int = wire.PROBE, session: int = SESSION) -> list[int]:
        r = [0] * fastio.RECORD_FIELDS
        r[R_PATH], r[R_KIND], r[R_SEQ], r[R_RX], r[R_SESSION] = path, kind, seq, rx, session
        return r

    rx = 2_000_000_000
    records = np.array(
        [
            record(0, 3, rx),
            record(0, 5, rx + 10),
            record(0, 4, rx + 20),  # reordered: older than 5
            record(1, 6, rx + 30),  # older than the echo already held (7)
            record(0, 9, rx + 40, kind=wire.TRAIN),
            record(2, 1, rx + 50),  # a session the path does not know yet: a restart
            record(9, 1, rx + 60),  # no such path
            record(1, 8, rx + 70),  # beyond n: not read
        ],
        dtype=np.int64,
    )
    assert pacer.note_arrivals(records, 7, in_session) == 1
    seam = clockseam.ClockSeam(offset, drift, epoch)
    assert echo_seq.tolist() == [5, 7, -1]
    assert echo_rx.tolist() == [seam.apply(rx + 10), 70, 0]
    with pytest.raises(ValueError, match="records"):
        pacer.note_arrivals(records, 9, in_session)  # more records than the array holds
    with pytest.raises(ValueError, match="in_session"):
        pacer.note_arrivals(records, 1, in_session[:2])
    with pytest.raises(ValueError, match="count of records"):
        pacer.note_arrivals(records, -1, in_session)
