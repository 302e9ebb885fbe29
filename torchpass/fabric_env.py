"""The fabric part of a rank's environment: which HCAs NCCL must avoid, which device its sockets use, and
which NCCL versions can fail a running communicator over to another port on their own.

Torch-free: the node agent builds the environment of every process it starts from this module, and a rank
(:mod:`torchpass.rank.backends`) asks it which path its NCCL version gets.

* ``NCCL_IB_HCA``: the node daemon's LinkPass reports the HCAs behind its dead or gray NICs (down, no live
  path, a Fleet Lens suspect; ``avoid_hcas`` of ``clockwork node status``). NCCL reads ``NCCL_IB_HCA`` once per
  process, when its IB transport starts (the first communicator), so an exclusion only reaches processes that
  start after it: the agent puts it in every process it starts from then on, and the daemon's GPU health watch
  moves the node's ranks into such processes at the next step boundary (``[health] hca_down_move_s``).
* ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME``: the device that holds the node's address, so NCCL's bootstrap
  and socket transport and the script's own gloo groups leave by the address LinkPass keeps reachable, never by
  whichever NIC the kernel picks. Only where the address is the device's one IPv4 address: both libraries take
  a device's first address, and on ``lo`` (where the sandbox puts it) that is 127.0.0.1.
* ``NCCL_IB_RESILIENCY_PORT_FAILOVER=1`` from NCCL :data:`PORT_FAILOVER_MIN` on: NCCL moves a running
  communicator's queue pairs to another port of its (merged) device when one fails, without a rebuild.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NCCL_IB_HCA = "NCCL_IB_HCA"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_PORT_FAILOVER = "NCCL_IB_RESILIENCY_PORT_FAILOVER"
ENV_NCCL_VERSION = "TORCHPASS_NCCL_VERSION"  # "2.29.7": what the agent assumes when the rank cannot tell it

#: The first NCCL with ``NCCL_IB_RESILIENCY_PORT_FAILOVER`` (port failover inside a running communicator).
PORT_FAILOVER_MIN = (2, 29, 7)


@dataclass(frozen=True)
class NcclPath:
    """What a dead HCA costs a rank with this NCCL: ``port_failover`` (the communicator survives) or not."""

    version: tuple[int, int, int] | None
    port_failover: bool
    why: str


def parse_version(value: object) -> tuple[int, int, int] | None:
    """``(2, 29, 7)`` from torch's tuple, NCCL's integer code (22907 / 2907) or ``"2.29.7"``; None if unknown."""
    if isinstance(value, tuple | list) and len(value) >= 3 and all(isinstance(v, int) for v in value[:3]):
        return (int(value[0]), int(value[1]), int(value[2]))
    if isinstance(value, int) and value > 0:
        major = value // 10000 if value >= 10000 else value // 1000
        rest = value % 10000 if value >= 10000 else value % 1000
        return (major, rest // 100, rest % 100)
    if isinstance(value, str):
        parts = value.strip().split("+")[0].split(".")
        if len(parts) >= 3 and all(p.isdigit() for p in parts[:3]):
            return (int(parts[0]), int(parts[1]), int(parts[2]))
    return None


def nccl_path(version: tuple[int, int, int] | None, *, cuda: bool = True) -> NcclPath:
    """Which path a dead HCA takes with this NCCL version (None: unknown)."""
    if not cuda:
        return NcclPath(None, False, "no CUDA here: no NCCL, the RDMA path does not apply (gloo)")
    if version is None:
        return NcclPath(None, False, "NCCL version unknown: a dead HCA is handled by a rebuild at the next step")
    text = ".".join(map(str, version))
    if version >= PORT_FAILOVER_MIN:
        return NcclPath(version, True, f"NCCL {text}: {NCCL_PORT_FAILOVER}=1, a running communicator fails over")
    floor = ".".join(map(str, PORT_FAILOVER_MIN))
    return NcclPath(version, False, f"NCCL {text} < {floor}: no port failover, a dead HCA needs a rebuild")


def exclude_hcas(current: str | None, hcas: Iterable[str]) -> str | None:
    """``NCCL_IB_HCA`` that keeps what ``current`` (the user's or the site's value) says and avoids ``hcas``.

    Empty or an exclusion list (``^a,b``): the union, as an exclusion. An inclusion list (``a,b`` or exact
    ``=a,b``, entries may carry ``:port``): the avoided HCAs are taken out; if none is left, an exclusion of them
    (NCCL then uses what remains). Nothing to avoid: ``current`` unchanged."""
    avoid = sorted(set(hcas))
    if not avoid:
        return current
    value = (current or "").strip()
    if not value or value.startswith("^"):
        listed = [e for e in value.lstrip("^").split(",") if e]
        return "^" + ",".join(listed + [h for h in avoid if h not in {e.split(":")[0] for e in listed}])
    exact = value.startswith("=")
    kept = [e for e in value.lstrip("=").split(",") if e and e.split(":")[0] not in avoid]
    if not kept:
        return "^" + ",".join(avoid)
    return ("=" if exact else "") + ",".join(kept)


# ----- the device that holds an address (getifaddrs: a node address added to lo is not SIOCGIFADDR's) -------


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_uint8 * 4)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockaddrIn)),
    ("netmask", ctypes.c_void_p),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]


def interface_addresses() -> dict[str, list[str]]:
    """Every interface's IPv4 addresses, in the kernel's order (the first is what NCCL and gloo take)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: dict[str, list[str]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = (entry.name or b"").decode()
            out.setdefault(name, [])
            if entry.addr and entry.addr.contents.family == socket.AF_INET:
                out[name].append(socket.inet_ntoa(bytes(entry.addr.contents.addr)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return out


def socket_device(address: str, interfaces: Mapping[str, list[str]]) -> tuple[str | None, str]:
    """(device, "") for the device whose one IPv4 address is ``address``; (None, why) when there is none."""
    holders = [name for name, addrs in interfaces.items() if address in addrs]
    if not holders:
        return None, f"no interface holds the node address {address}"
    device = holders[0]
    others = [a for a in interfaces[device] if a != address]
    if others:
        return None, (
            f"the node address {address} shares {device} with {', '.join(others)}: NCCL and gloo would take "
            f"{interfaces[device][0]}; give the node address a device of its own to have them set"
        )
    return device, ""


@dataclass(frozen=True)
class FabricEnv:
    """The fabric variables a process gets, and what could not be set (said in the agent's event)."""

    env: dict[str, str]
    notes: list[str]


def fabric_environment(
    environ: Mapping[str, str],
    avoid_hcas: Mapping[str, str],
    address: str,
    interfaces: Mapping[str, list[str]] | None = None,
) -> FabricEnv:
    """The fabric variables for a process started now on a node whose LinkPass avoids ``avoid_hcas`` (HCA -> why)
    and whose stable address is ``address``. ``environ``'s own ``NCCL_IB_HCA`` is kept and narrowed."""
    env: dict[str, str] = {}
    notes: list[str] = []
    hca = exclude_hcas(environ.get(NCCL_IB_HCA), avoid_hcas)
    if hca is not None and hca != environ.get(NCCL_IB_HCA):
        env[NCCL_IB_HCA] = hca
    if interfaces is None:
        try:
            interfaces = interface_addresses()
        except OSError as exc:
            interfaces = {}
            notes.append(f"interfaces unreadable: {exc}")
    device, why = socket_device(address, interfaces)
    if device is None:
        notes.append(f"{NCCL_SOCKET_IFNAME} and {GLOO_SOCKET_IFNAME} left as they are: {why}")
    else:
        env[NCCL_SOCKET_IFNAME] = "=" + device  # '=': this device exactly, not every name it prefixes
        env[GLOO_SOCKET_IFNAME] = device
    return FabricEnv(env, notes)


# ----- the node daemon's view ------------------------------------------------------------------------

StatusReader = Callable[[], Mapping[str, Any]]


def daemon_status_reader(socket_path: str, timeout_s: float = 2.0) -> StatusReader:
    """The node daemon's ``status`` reply, through its control socket (any local user may ask)."""

    def read() -> Mapping[str, Any]:
        from clockwork.contracts.daemon_client import DaemonClient  # lazy: torchpass -> the daemon's client only

        with DaemonClient(Path(socket_path), timeout_s=timeout_s) as client:
            return client.status()

    return read


def avoid_hcas_of(status: Mapping[str, Any]) -> dict[str, str]:
    """HCA -> why, from a daemon status (none when LinkPass is off or predates ``avoid_hcas``)."""
    linkpass = status.get("linkpass")
    hcas = linkpass.get("avoid_hcas") if isinstance(linkpass, Mapping) else None
    if not isinstance(hcas, Mapping):
        return {}
    return {str(k): str(v) for k, v in hcas.items()}
