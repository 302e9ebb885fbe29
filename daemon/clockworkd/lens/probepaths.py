"""The probe paths of one node: its probing NICs, the paths each probes and receives, and the arrays C shares.

Why arrays: the C pacer thread sends a probe on every outgoing path each tick and answers the newest probe of
every incoming path with an echo, and the C receiver names each packet's incoming path by an index; neither
may touch a Python object per packet. So each NIC's outgoing paths are rows of int64 arrays (sequence numbers,
destinations, the transmit rings the round trips are matched against), and the incoming paths are indexes
into per-path arrays (session, newest probe seen, when it arrived). :class:`ProbePaths` lays them out once,
at start, and hands them to the pacer, which holds their buffers for the Lens's life: they are updated in
place from then on, never replaced.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clockwork.contracts.lens_model import NicId, nic_id, split_nic
from clockworkd.lens import fastio
from clockworkd.lens.clockseam import ClockSeam
from clockworkd.lens.pathwindow import PathWindow, Samples
from clockworkd.lens.peers import Plan
from linkpass.fabric import FabricMap

ECHO_RING = 1024  # transmit times kept per path for echoes (10 s of probes at 10 ms)


@dataclass
class OutPath:
    """One path a NIC probes: where its probes go, and which incoming path's probes its echoes answer."""

    peer: NicId
    addr: bytes  # struct sockaddr_in of the peer NIC's probe port
    dst: tuple[int, int]  # (node index, NIC index)
    reverse: int = -1  # index (ProbePaths.in_paths) of the peer's probes to this NIC (what we echo back), -1: none


@dataclass
class LocalNic:
    """One probing NIC. Per outgoing path k, the arrays the C sender reads and advances (row k each)."""

    name: str
    nic: NicId
    index: int
    ip: str
    sock: socket.socket
    out: list[OutPath] = field(default_factory=list)
    train_seq: int = 0
    train_next_peer: int = 0
    first_out: int = 0  # row of out[0] in ProbePaths.ring_seq/ring_tx
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # newest seq sent per path
    dst_node: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    dst_nic: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    addrs: bytes = b""  # the paths' sockaddr_in, back to back
    rev: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # OutPath.reverse per path
    path_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # (node, NIC) -> in path
    summary_to: dict[str, tuple[tuple[int, int], bytes]] = field(default_factory=dict)  # peer -> (dst, addr)


class ProbePaths:
    """``node``'s probe paths: empty until :meth:`open`, which opens the sockets and lays the paths out."""

    def __init__(self, fabric: FabricMap, node: str) -> None:
        self.fabric = fabric
        self.me = node
        self.nodes = sorted(fabric.nodes)
        self.node_index = {n: i for i, n in enumerate(self.nodes)}
        self.nic_names = {n: sorted(fabric.nodes[n].nics) for n in self.nodes}
        # (node index, NIC index) -> NIC address as the kernel stores it (for the source check)
        self.nic_ip = np.zeros((len(self.nodes), max(len(v) for v in self.nic_names.values())), dtype=np.uint32)
        for n, names in self.nic_names.items():
            for j, name in enumerate(names):
                self.nic_ip[self.node_index[n], j] = np.frombuffer(
                    socket.inet_aton(fabric.nodes[n].nics[name]), dtype=np.uint32
                )[0]
        self.local: list[LocalNic] = []
        self.incoming: dict[tuple[int, int, int], PathWindow] = {}  # (src node, src NIC, local NIC) -> window
        # Incoming paths by index (the C receiver names a packet's path by it) and their per-path state
        # that the per-batch filing and the C sender share: arrays, so neither touches a Python object per packet.
        self.in_paths: list[PathWindow] = []
        self.samples, self.rtt_samples = Samples(), Samples()  # every incoming path's, slot = index in in_paths
        self.in_session = np.zeros(0, dtype=np.int64)  # PathWindow.session, as the filing checks it
        self.in_echo_seq = np.zeros(0, dtype=np.int64)  # newest probe received per path (echoed back), -1: none
        self.in_echo_rx = np.zeros(0, dtype=np.int64)  # when it arrived (our clock, ns)
        self.in_rev_out = np.zeros(0, dtype=np.int64)  # row in ring_seq/ring_tx of the reverse path, -1: none
        self.ring_seq = np.zeros((0, ECHO_RING), dtype=np.int64)  # per outgoing path: seq % ECHO_RING -> seq
        self.ring_tx = np.zeros((0, ECHO_RING), dtype=np.int64)  # ... and its transmit time (our clock)

    def open(self, plan: Plan, probed_by: Plan, port: int) -> None:
        """Open a socket on each of this node's NICs in ``plan`` and lay out the paths it probes (``plan``)
        and receives (``probed_by``). A socket opened before a failure is in ``local``: :meth:`close` it."""
        me = self.fabric.node(self.me)
        ncols = self.nic_ip.shape[1]
        for j, name in enumerate(self.nic_names[self.me]):
            nic = nic_id(self.me, name)
            if nic not in plan:
                continue
            sock = fastio.open_socket(me.nics[name], port, name)
            local = LocalNic(name, nic, j, me.nics[name], sock)
            for peer in plan[nic]:
                pnode, pname = split_nic(peer)
                addr = fastio.sockaddr_in(self.fabric.nodes[pnode].nics[pname], port)
                local.out.append(OutPath(peer, addr, (self.node_index[pnode], self.nic_names[pnode].index(pname))))
            local.path_of = np.full(len(self.nodes) * ncols, -1, dtype=np.int64)
            local.summary_to = {
                peer: (
                    (self.node_index[peer], self.nic_names[peer].index(name)),
                    fastio.sockaddr_in(self.fabric.nodes[peer].nics[name], port),
                )
                for peer in self.nodes
                if peer != self.me and name in self.fabric.nodes[peer].nics
            }
            for src in probed_by.get(nic, ()):
                snode, sname = split_nic(src)
                key = (self.node_index[snode], self.nic_names[snode].index(sname), j)
                self.incoming[key] = PathWindow(
                    src, nic, samples=self.samples, rtts=self.rtt_samples, slot=len(self.in_paths)
                )
                local.path_of[key[0] * ncols + key[1]] = len(self.in_paths)
                self.in_paths.append(self.incoming[key])
            self.local.append(local)
        index = {(pw.dst, pw.src): i for i, pw in enumerate(self.in_paths)}
        rows = 0
        self.in_rev_out = np.full(len(self.in_paths), -1, dtype=np.int64)
        for local in self.local:
            local.first_out = rows
            for k, path in enumerate(local.out):
                path.reverse = index.get((local.nic, path.peer), -1)
                if path.reverse >= 0:
                    self.in_rev_out[path.reverse] = rows + k
            rows += len(local.out)
            local.seq = np.zeros(len(local.out), dtype=np.int64)
            local.dst_node = np.array([p.dst[0] for p in local.out], dtype=np.int64)
            local.dst_nic = np.array([p.dst[1] for p in local.out], dtype=np.int64)
            local.addrs = b"".join(p.addr for p in local.out)
            local.rev = np.array([p.reverse for p in local.out], dtype=np.int64)
        self.ring_seq = np.full((rows, ECHO_RING), -1, dtype=np.int64)
        self.ring_tx = np.zeros((rows, ECHO_RING), dtype=np.int64)
        self.in_session = np.full(len(self.in_paths), -1, dtype=np.int64)
        self.in_echo_seq = np.full(len(self.in_paths), -1, dtype=np.int64)
        self.in_echo_rx = np.zeros(len(self.in_paths), dtype=np.int64)

    def start_pacer(self, key: bytes, session: int, interval_ns: int, pair_every: int, seam: ClockSeam | None) -> Any:
        """Hand every NIC's outgoing paths to a new pacer thread (``_probeio.Pacer``), which probes them from now on.

        One batch per NIC per tick, a probe to every planned peer, one of them (peers take turns every
        ``pair_every`` ticks) a coded pair, sent first: its transmit stamp is the one the clock sync needs;
        the others' go out microseconds later, which only shifts their paths' baselines. The arrays it is
        given stay these objects for the Lens's life (it holds their buffers): the echo arrays are updated
        in place, and only inside ``with pacer``.
        """
        pacer = fastio.probeio().Pacer(
            key,
            self.node_index[self.me],
            session,
            interval_ns,
            pair_every,
            self.in_echo_seq,
            self.in_echo_rx,
            (seam.offset_ns, seam.drift_ppm, seam.epoch_ns) if seam else None,
        )
        for local in self.local:
            if not local.out:
                continue
            rows = slice(local.first_out, local.first_out + len(local.out))
            pacer.add_nic(
                local.sock.fileno(),
                local.index,
                local.seq,
                local.dst_node,
                local.dst_nic,
                local.addrs,
                self.ring_seq[rows],
                self.ring_tx[rows],
                local.rev,
            )
        pacer.start()
        return pacer

    def close(self) -> None:
        """Close the NICs' sockets (stop the pacer first: it sends on them)."""
        for local in self.local:
            local.sock.close()
        self.local.clear()
