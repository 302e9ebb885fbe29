"""Collective backends behind one interface: form a generation's process group, abort it, destroy it.

Two things differ between gloo and NCCL and nothing else in TorchPass needs to know which is in use:

* **Leaving a broken collective.** A gloo collective whose peer process died fails at once ("connection
  closed by peer"). A peer that goes silent without closing its sockets (a node that lost power, a SIGSTOP)
  would hold the survivors until the collective timeout; and ``ProcessGroupGloo.abort()`` does not unblock an
  in-flight collective (measured on torch 2.13). :class:`GlooBackend` therefore remembers the TCP sockets the
  group opened and, on abort, shuts them down from the control thread: the blocked collective then fails
  within milliseconds. This needs no privilege (they are this process's own sockets), unlike ``ss -K``.
* **NCCL** (:class:`NcclBackend`, written for production, not runnable on these CPU machines): non-blocking
  communicators (``config.blocking = 0``) so that init and collectives can be aborted, an explicit abort of
  the group when the coordinator announces a newer generation, and the c10d settings that stop the NCCL
  watchdog from killing the process on its own (TorchPass decides what happens after a failure).

The process group of the current generation is torch.distributed's default group, so user code and libraries
that call ``dist.get_rank()`` keep working; it is destroyed and re-created (with a fresh store prefix) at
every generation. DDP itself is never rebuilt: it is constructed over a private one-rank group
(:meth:`CommBackend.local_group`) and all real gradient traffic goes through TorchPass's communication hook
on the current default group.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from torchpass.config import TorchPassConfig
from torchpass.fabric_env import (
    NCCL_IB_HCA,
    NCCL_PORT_FAILOVER,
    NcclPath,
    avoid_hcas_of,
    daemon_status_reader,
    exclude_hcas,
    nccl_path,
    parse_version,
)
from torchpass.rank.retired_groups import RetiredGroups
from torchpass.rank.torch_compat import abort_all_groups, forget_default_group, restart_group_names
from torchpass.rank_env import ENV_DAEMON_SOCKET

__all__ = ["CommBackend", "GlooBackend", "NcclBackend", "make_backend"]

log = logging.getLogger("clockwork.torchpass.backend")


def _socket_fds() -> dict[int, str]:
    """This process's socket file descriptors -> their ``socket:[inode]`` names."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = link
    return out


def _is_peer_tcp_socket(fd: int, skip_ports: set[int]) -> bool:
    """A connected TCP socket (not a listener) whose ports are not in ``skip_ports`` (the stores')."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        local_port = sock.getsockname()[1]
        peer_port = sock.getpeername()[1]
        return local_port not in skip_ports and peer_port not in skip_ports
    except OSError:
        return False
    finally:
        sock.close()  # closes our duplicate only


class CommBackend(ABC):
    """One process's view of the current generation's process group."""

    name = ""

    def __init__(self, config: TorchPassConfig) -> None:
        self.config = config
        self.timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        self.generation = -1  # generation whose group is current; -1 = none
        self._lock = threading.Lock()
        self._local: dist.ProcessGroup | None = None
        self._hooked = False
        self.user_group: dist.ProcessGroup | None = None  # the script's collectives (see _init_process_group)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where tensors must be for this backend's collectives (and for state transfer)."""

    def prepare_env(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Set the environment this backend needs before any group exists (called once, at init)."""

    @abstractmethod
    def form_group(self, store: dist.Store, rank: int, world_size: int, generation: int, skip_ports: set[int]) -> None:
        """Create the default process group for ``generation`` over ``store`` (all members call this)."""

    def _init_process_group(self, backend: str, **kwargs: Any) -> None:
        """``dist.init_process_group``, keeping one ``[rankN]:`` excepthook: torch chains a new one on every call,
        and a rank that formed 30 generations would prefix each line of its last traceback 30 times.

        Then the generation's second group, over the same members: the script's own collectives run there
        (``ctx.all_reduce``, transparent mode's interposed ``dist`` calls), so that ranks disagreeing on which
        steps run one (a counter of the script's own) can never pair it with a gradient bucket or a buffer
        broadcast of the default group. Destroyed and aborted with it."""
        hook = sys.excepthook
        restart_group_names()  # the same names on every member, whatever failed in this process before
        dist.init_process_group(backend, **kwargs)
        if self._hooked:
            sys.excepthook = hook
        self._hooked = True
        self.user_group = dist.new_group(timeout=self.timeout)  # not gloo's 30 min default

    def new_subgroup(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """A group of ``ranks`` of the current generation (a sharded model's mesh: :mod:`torchpass.sharded.shard_mesh`),
        None on a rank outside it; every member of the generation calls this for every subgroup, in the same
        order. It is aborted and destroyed with the generation's group."""
        return _member_group(dist.new_group(ranks, timeout=self.timeout))

    def abort(self, superseded_by: int) -> None:
        """Generation ``superseded_by`` exists: if the current group belongs to an older one, make every in-flight
        collective of it fail now (thread-safe, idempotent). Checked under the lock that :meth:`form_group` sets the
        generation under: checked before it, a push of generation N that raced with this rank forming N itself would
        abort the group just formed."""
        with self._lock:
            if 0 <= self.generation < superseded_by:
                self._abort_locked()

    @abstractmethod
    def _abort_locked(self) -> None:
        """The backend's abort of the current group (called under the lock)."""

    def destroy(self) -> None:
        """Destroy the current group, if any (main thread). Safe on a broken group."""
        with self._lock:
            self._forget()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception as exc:  # a broken group may complain while being torn down
                    log.debug("destroy_process_group: %s", exc)
            self.generation = -1
            self.user_group = None

    def _forget(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Drop what :meth:`abort` would act on (called under the lock)."""

    @property
    def active(self) -> bool:
        """Whether a group is formed."""
        return self.generation >= 0 and dist.is_initialized()

    def local_group(self) -> dist.ProcessGroup:
        """A private one-rank group: what DDP is constructed over, so it never talks to the real group."""
        if self._local is None:
            self._local = self._make_local_group()
        return self._local

    def _make_local_group(self) -> dist.ProcessGroup:
        store = dist.HashStore()
        backend = dist.ProcessGroupGloo(store, 0, 1, self.timeout)
        group = dist.ProcessGroup(store, 0, 1)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        return group


def _member_group(group: Any) -> dist.ProcessGroup | None:
    """What ``dist.new_group`` returned: the group for a member, None for everyone else."""
    return group if isinstance(group, dist.ProcessGroup) else None


_BOUND_GLOO = "torchpass_gloo"
BOUND_GLOO = _BOUND_GLOO  # the registered name of gloo bound to one address; it is gloo to a training script
_bound_gloo_host = ""


def _bound_gloo(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo backend whose device listens on :data:`_bound_gloo_host` (see :class:`GlooBackend`)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, stable since torch 1.x
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_bound_gloo_host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


class GlooBackend(CommBackend):
    """gloo over TCP; abort = shut down the group's own sockets (unblocks a collective in milliseconds).

    ``bind_host`` (Slurm mode: the node's stable address) makes gloo listen on that address. Neither
    ``GLOO_SOCKET_IFNAME`` (the node address may sit on no interface of its own: LinkPass moves its routes
    between NICs) nor ``init_process_group('gloo')`` (it ignores gloo options) can say so, hence a backend
    registered under the name ``torchpass_gloo``, which is plain ``ProcessGroupGloo`` with a device created for
    that address. ``dist.get_backend()`` then answers ``torchpass_gloo``. Without ``bind_host`` gloo picks its
    device as usual (``GLOO_SOCKET_IFNAME``, else the hostname's address).
    """

    name = "gloo"

    def __init__(self, config: TorchPassConfig, bind_host: str = "") -> None:
        super().__init__(config)
        self._sockets: dict[int, str] = {}
        self._skip: set[int] = set()  # the stores' ports: their sockets are never the group's
        self._groups: list[Any] = []  # the current generation's groups: retired, not destroyed (see destroy)
        self.retired = RetiredGroups()
        self.bind_host = bind_host
        if bind_host:
            global _bound_gloo_host
            _bound_gloo_host = bind_host
            if _BOUND_GLOO not in dist.Backend.backend_list:
                dist.Backend.register_backend(_BOUND_GLOO, _bound_gloo, devices=["cpu"])

    @property
    def device(self) -> torch.device:
        """gloo works on CPU tensors."""
        return torch.device("cpu")

    def form_group(self, store: dist.Store, rank: int, world_size: int, generation: int, skip_ports: set[int]) -> None:
        """Create the group and remember the peer sockets it opened (gloo connects the full mesh eagerly)."""
        before = _socket_fds()
        backend = _BOUND_GLOO if self.bind_host else "gloo"
        self._init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
        after = _socket_fds()
        opened = {fd: link for fd, link in after.items() if before.get(fd) != link}
        with self._lock:
            self._sockets = {fd: link for fd, link in opened.items() if _is_peer_tcp_socket(fd, skip_ports)}
            self._skip = set(skip_ports)
            self._groups = [dist.group.WORLD, self.user_group]
            self.generation = generation
        log.debug("gloo group g%d: rank %d/%d, %d peer sockets", generation, rank, world_size, len(self._sockets))

    def new_subgroup(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """A subgroup whose peer sockets (gloo connects them all at once) an abort shuts down too."""
        before = _socket_fds()
        group = super().new_subgroup(ranks)
        opened = {fd: link for fd, link in _socket_fds().items() if before.get(fd) != link}
        with self._lock:
            self._sockets.update({fd: link for fd, link in opened.items() if _is_peer_tcp_socket(fd, self._skip)})
            self._groups.append(group)
        return group

    def destroy(self) -> None:
        """Shut the group's sockets down first, then destroy it. Destroying alone closes a group's sockets only
        when its last reference goes, and a sharded model's mesh groups may be referenced for a while longer
        (FSDP's state, a work still held): a peer blocked on such a socket, in a collective this rank abandoned,
        would wait for the collective timeout instead of failing now.

        The generation's groups are retired first (:class:`~torchpass.rank.retired_groups.RetiredGroups`): held
        past their timeout, so that destroying them here does not join a worker thread stuck in a send gloo never
        fails (the next generation waited 30 s for it)."""
        self._shut_down(logging.DEBUG)
        with self._lock:
            groups, self._groups = self._groups, []
        self.retired.retire(groups, self.timeout.total_seconds())
        super().destroy()

    def _abort_locked(self) -> None:
        """Shut down (not close: gloo still owns the descriptors) every peer socket of the group."""
        self._shut_down_locked(logging.INFO)

    def _shut_down(self, level: int) -> None:
        with self._lock:
            self._shut_down_locked(level)

    def _shut_down_locked(self, level: int) -> None:
        for fd, link in self._sockets.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue  # gloo closed it and the number was reused: not ours any more
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.close()
        if self._sockets:
            log.log(level, "aborted gloo group g%d (%d sockets shut down)", self.generation, len(self._sockets))
        self._sockets = {}

    def _forget(self) -> None:
        self._sockets = {}


class NcclBackend(CommBackend):
    """NCCL with non-blocking communicators and explicit abort (needs CUDA; not exercised on CPU machines).

    Requirements: PyTorch >= 2.6 (``ProcessGroupNCCL.Options.config.blocking``, eager init with
    ``device_id``, ``_abort_process_group``) and NCCL >= 2.18 (abortable non-blocking communicators).
    """

    name = "nccl"

    # c10d settings: errors and timeouts surface in the Work objects (and so in TorchPass's hook) instead of
    # the watchdog tearing the process down; TorchPass aborts the communicator itself.
    ENV: ClassVar[dict[str, str]] = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicator, keep the process
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",  # the heartbeat monitor would kill a rank stuck in recovery
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ABORT_IN_DESTROY_PG": "1",
    }

    def __init__(self, config: TorchPassConfig, local_rank: int) -> None:
        super().__init__(config)
        self.local_rank = local_rank
        self.nccl_path: NcclPath | None = None
        self._ib_started = False  # NCCL reads NCCL_IB_HCA once per process: at its first communicator

    @property
    def device(self) -> torch.device:
        """This rank's GPU."""
        return torch.device("cuda", self.local_rank)

    def prepare_env(self) -> None:
        """Apply :attr:`ENV` (without overriding what the user set) and bind this process to its GPU."""
        for key, value in self.ENV.items():
            os.environ.setdefault(key, value)
        # NCCL >= 2.29.7 moves a running communicator's queue pairs off a failed port itself; older ones need the
        # rebuild at the next step (the node daemon's hca.down move). Said once per rank, in its log.
        cuda = torch.cuda.is_available()
        self.nccl_path = nccl_path(parse_version(torch.cuda.nccl.version()) if cuda else None, cuda=cuda)
        if self.nccl_path.port_failover:
            os.environ.setdefault(NCCL_PORT_FAILOVER, "1")
        log.info("RDMA path: %s", self.nccl_path.why)
        torch.cuda.set_device(self.device)

    def _exclude_dead_hcas(self) -> None:
        """Before this process's first communicator: narrow ``NCCL_IB_HCA`` by the HCAs the node daemon avoids
        now. A spare started before an HCA died gets the exclusion its node agent gives processes started after."""
        if self._ib_started:
            return
        self._ib_started = True
        sock = os.environ.get(ENV_DAEMON_SOCKET, "")
        if not sock:
            return
        try:
            avoid = avoid_hcas_of(daemon_status_reader(sock)())
        except Exception as exc:  # the daemon restarting: keep what the agent gave this process
            log.warning("node daemon unreadable, NCCL_IB_HCA as started: %s: %s", type(exc).__name__, exc)
            return
        value = exclude_hcas(os.environ.get(NCCL_IB_HCA), avoid)
        if value is not None and value != os.environ.get(NCCL_IB_HCA):
            log.warning("NCCL_IB_HCA=%s (the node daemon avoids %s)", value, ", ".join(sorted(avoid)))
            os.environ[NCCL_IB_HCA] = value

    def form_group(self, store: dist.Store, rank: int, world_size: int, generation: int, skip_ports: set[int]) -> None:
        """Eagerly initialised, non-blocking NCCL communicator for this generation."""
        self._exclude_dead_hcas()
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0
        options._timeout = self.timeout
        self._init_process_group(
            "nccl",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
            pg_options=options,
            device_id=self.device,
        )
        with self._lock:
            self.generation = generation

    def new_subgroup(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """A non-blocking NCCL subgroup (split from the eagerly initialised default communicator), so that the
        abort of every group (:meth:`abort`, c10d's abort of the default group) reaches it too."""
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0
        options._timeout = self.timeout
        return _member_group(dist.new_group(ranks, timeout=self.timeout, pg_options=options))

    def _abort_locked(self) -> None:
        """ncclCommAbort on the group's communicators: in-flight kernels exit, their Works fail."""
        if not dist.is_initialized():
            return
        try:
            abort_all_groups()
        except Exception as exc:
            log.warning("NCCL abort failed: %s", exc)

    def destroy(self) -> None:
        """Abort, then destroy. An NCCL group whose eager init failed (a peer gone, two ranks on one GPU) can be
        registered as the default group yet refuse ``destroy_process_group``; then the next generation's init
        fails with "default process group twice" (seen on an H200). Such a group is dropped from c10d's books."""
        if dist.is_initialized():
            try:
                abort_all_groups()
            except Exception as exc:
                log.debug("NCCL abort before destroy: %s", exc)
        super().destroy()
        if dist.is_initialized():
            log.warning("NCCL process group could not be destroyed; dropping it from torch.distributed's state")
            forget_default_group()

    def _make_local_group(self) -> dist.ProcessGroup:
        self._exclude_dead_hcas()  # NCCL's first communicator may be this one
        store = dist.HashStore()
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        nccl = dist.ProcessGroupNCCL(store, 0, 1, options)
        group = dist.ProcessGroup(store, 0, 1)
        group._register_backend(self.device, dist.ProcessGroup.BackendType.NCCL, nccl)
        group._register_backend(
            torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, 0, 1, self.timeout)
        )
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        return group


def make_backend(config: TorchPassConfig, local_rank: int = 0, gloo_host: str = "") -> CommBackend:
    """The backend ``config.backend`` names ('auto': NCCL when CUDA is usable, else gloo bound to
    ``gloo_host`` when given)."""
    name = config.backend
    if name == "auto":
        name = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if name == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError("backend 'nccl' needs CUDA and a torch build with NCCL; use backend='gloo' here")
        return NcclBackend(config, local_rank)
    return GlooBackend(config, gloo_host)
