"""How a rank process starts (:func:`init`, ``torchpass.init``): join the job its launcher started, or train alone.

A rank registers with the job's coordinator and gets its :class:`~torchpass.rank.context.Context`; a spare blocks
here until it is given a slot. Run without a launcher, the script trains alone as slot 0 of a one-rank job with an
in-process coordinator (the one place a rank runs a coordinator).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import os
from typing import Any

import torch.distributed as dist

from clockwork.contracts.versions import VERSION
from torchpass.auth import ENV_JOB_KEY, JobKey
from torchpass.config import TorchPassConfig
from torchpass.coordinator.service import Coordinator
from torchpass.errors import TorchPassError
from torchpass.events import DaemonEventSink, EventSink, tee
from torchpass.rank.backends import make_backend
from torchpass.rank.context import Context
from torchpass.rank.control import ControlChannel, CoordinatorLost, CoordinatorRefused, JobStopped
from torchpass.rank.output import configure_logging, whole_lines_on_shared_output
from torchpass.rank_env import ENV_DAEMON_SOCKET, ENV_GLOO_HOST, LaunchEnv, die_with_parent

__all__ = ["init"]


def init(config: TorchPassConfig | None = None, *, event_sink: EventSink | None = None, **overrides: Any) -> Context:
    """Join the job the launcher started (``torchpass run``); returns this rank's :class:`Context`.

    The configuration is the launcher's (``TORCHPASS_CONFIG``) unless ``config`` is given; keyword arguments
    override single fields (unknown names are errors). A spare process blocks here until it is given a slot
    (and exits with status 0 if the job ends first). Run without a launcher, the script trains alone as slot
    0 of a one-rank job, with an in-process coordinator.
    """
    cfg = (config or TorchPassConfig.from_env()).with_overrides(**overrides)
    configure_logging(cfg.log_level)
    env = LaunchEnv.from_environ()
    coordinator = None
    if env is None:
        if JobKey.from_environ() is None:  # alone, this process is the whole job: it makes the job's key
            os.environ[ENV_JOB_KEY] = JobKey.new().hex
        coordinator = Coordinator(1, cfg)
        env = LaunchEnv(coordinator.start(), "w0", "slot:0", 1, "127.0.0.1", "", False)
    else:
        whole_lines_on_shared_output()
    if env.local or env.agent >= 0:
        die_with_parent()
    daemon_socket = os.environ.get(ENV_DAEMON_SOCKET, "")
    if daemon_socket and env.job_id.isdigit():
        event_sink = tee(event_sink, DaemonEventSink(int(env.job_id), daemon_socket))
    backend = make_backend(cfg, int(os.environ.get("LOCAL_RANK", "0")), os.environ.get(ENV_GLOO_HOST, ""))
    backend.prepare_env()
    store_server = dist.TCPStore(
        env.host, 0, None, True, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s), wait_for_workers=False
    )
    channel = ControlChannel(
        env.coordinator,
        env.worker_id,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        coordinator_timeout_s=cfg.coordinator_timeout_s,
        rpc_timeout_s=cfg.rpc_timeout_s,
    )
    ctx = Context(cfg, env, channel, backend, store_server, event_sink, coordinator)
    # DDP's constructor imports torch._dynamo lazily (about 1 s here). Pay it before registering, so that a
    # spare is fully warm when the coordinator can first hand it a slot.
    importlib.import_module("torch._dynamo")
    if cfg.gc_freeze:
        gc.freeze()
    try:
        channel.call(
            "register",
            pid=os.getpid(),
            host=env.host,
            store_port=store_server.port,
            role=env.role,
            agent=env.agent,
            version=VERSION,  # the coordinator refuses another release than its own (an older or newer image)
        )
    except CoordinatorRefused as exc:
        raise TorchPassError(f"the job's coordinator refused this rank: {exc}") from None
    except JobStopped as stop:
        ctx.link.exit_stopped(stop)
    except CoordinatorLost as exc:
        raise TorchPassError(f"cannot reach the coordinator: {exc}") from None
    channel.start()
    atexit.register(ctx.close)
    if env.role == "spare":
        ctx.log.info("spare ready, waiting for a slot")
        info = ctx.rejoiner.await_generation(-1)
        ctx._pending = info
        slot = info.slot_of(env.worker_id)
        ctx.position.slot = slot if slot is not None else -1
        ctx.log.info("assigned slot %d in generation %d (%s)", ctx.slot, info.gen, info.reason)
    return ctx
