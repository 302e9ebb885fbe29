"""Prometheus exposition of one node daemon's Fleet Lens snapshot.

The Lens component replaces its status snapshot (a plain dict: node, time, paths, clock, suspects,
counters) about every half second by swapping a reference; this module only ever *reads* that
reference, through a callable, at scrape time. So the exporter needs no lock, holds no copy that
could go stale, and costs nothing between scrapes.

Everything goes through a private :class:`~prometheus_client.CollectorRegistry`: the process-wide
default registry belongs to whoever embeds the daemon (and tests create many exporters), so
registering there would leak series across instances and fail on the second registration.

Units follow Prometheus conventions (seconds, ratios), while the snapshot speaks microseconds: the
conversion happens here and nowhere else. ``None`` means "not measured" (no clock offset yet, a path
with no probes received) and is left out rather than exported as 0, which would read as a perfect
path on a dashboard.
"""

from __future__ import annotations

import logging
import math
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("clockwork.lens")

Snapshot = Mapping[str, Any]
SnapshotSource = Callable[[], Snapshot | None]

_US = 1e-6
_OWD_STATS = (("min", "owd_min_us"), ("p50", "owd_p50_us"), ("p99", "owd_p99_us"))
_COUNTERS = (
    ("clockwork_lens_probes_sent", "probes_sent", "Probes this node sent."),
    ("clockwork_lens_probes_received", "probes_received", "Probes this node received and accepted."),
    ("clockwork_lens_probes_rejected", "rejected", "Probes this node received and dropped (bad tag, stale, unknown)."),
    ("clockwork_lens_send_errors", "send_errors", "Probe sends the kernel refused."),
    (
        "clockwork_lens_probe_ticks_skipped",
        "probe_ticks_skipped",
        "Probe ticks skipped because the node was too busy to make them in time (the paths' loss counts exclude them).",
    ),
)

# Every sample name the exporter can emit: dashboards and alert rules are checked against this set.
METRIC_NAMES: frozenset[str] = frozenset(
    {
        "clockwork_lens_enabled",
        "clockwork_lens_snapshot_time_seconds",
        "clockwork_lens_owd_seconds",
        "clockwork_lens_loss_ratio",
        "clockwork_lens_jitter_seconds",
        "clockwork_lens_path_bad",
        "clockwork_lens_clock_offset_seconds",
        "clockwork_lens_clock_uncertainty_seconds",
        "clockwork_lens_loop_residual_seconds",
        "clockwork_lens_suspect",
        *(f"{name}_total" for name, _, _ in _COUNTERS),
    }
)


def _num(value: Any) -> float | None:
    """A float for a real number, None for anything else (None, bools, strings, NaN).

    The snapshot crosses process boundaries as msgpack/JSON and may come from a newer or older
    daemon; a malformed field must cost one sample, never the whole scrape (an exception in a
    collector turns the scrape into an HTTP 500 and blanks every panel).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _dicts(value: Any) -> Iterator[Mapping[str, Any]]:
    """The mapping items of a list (anything else in it, or a non-list, is skipped)."""
    if isinstance(value, list | tuple):
        yield from (item for item in value if isinstance(item, Mapping))


class LensCollector(Collector):
    """Turns the latest snapshot into metric families at each scrape.

    ``snapshot`` is called once per scrape; whatever it returns is read and never kept, so the
    daemon can swap its snapshot from the event loop while the HTTP thread scrapes.
    """

    def __init__(self, snapshot: SnapshotSource) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so the registry knows the names without taking a snapshot."""
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        try:
            snap = self._snapshot()
        except Exception:  # the daemon's callable: a bug there must not break the HTTP thread
            log.exception("Fleet Lens metrics: taking the snapshot failed")
            snap = None
        return list(self._families(snap if isinstance(snap, Mapping) else None))

    def _families(self, snap: Snapshot | None) -> Iterator[Metric]:
        enabled = GaugeMetricFamily("clockwork_lens_enabled", "1 when Fleet Lens is probing on this node.")
        stamp = GaugeMetricFamily(
            "clockwork_lens_snapshot_time_seconds",
            "Unix time of the snapshot these metrics come from (a stale value means the prober stalled).",
        )
        owd = GaugeMetricFamily(
            "clockwork_lens_owd_seconds",
            "One-way delay of a directed NIC pair over the last window, clock-offset corrected.",
            labels=["src", "dst", "stat"],
        )
        loss = GaugeMetricFamily(
            "clockwork_lens_loss_ratio", "Share of probes lost on a directed NIC pair.", labels=["src", "dst"]
        )
        jitter = GaugeMetricFamily(
            "clockwork_lens_jitter_seconds",
            "Mean absolute difference of consecutive one-way delays on a directed NIC pair.",
            labels=["src", "dst"],
        )
        bad = GaugeMetricFamily(
            "clockwork_lens_path_bad", "1 when the path is outside its own baseline.", labels=["src", "dst"]
        )
        offset = GaugeMetricFamily(
            "clockwork_lens_clock_offset_seconds",
            "Estimated offset of a node's clock from the reference clock.",
            labels=["node", "reference"],
        )
        uncertainty = GaugeMetricFamily(
            "clockwork_lens_clock_uncertainty_seconds", "Uncertainty of a node's clock offset.", labels=["node"]
        )
        residual = GaugeMetricFamily(
            "clockwork_lens_loop_residual_seconds",
            "RMS residual of the clock offsets around the probe graph's loops (how self-consistent they are).",
        )
        suspect = GaugeMetricFamily(
            "clockwork_lens_suspect",
            "Confidence (0..1) that a link is faulty; present only while the link is suspected.",
            labels=["link", "nic", "direction", "kinds"],
        )
        counters = [CounterMetricFamily(name, doc) for name, _, doc in _COUNTERS]

        if snap is not None:
            enabled.add_metric([], 1.0 if snap.get("enabled") else 0.0)
            if (t := _num(snap.get("time"))) is not None:
                stamp.add_metric([], t)
            for path in _dicts(snap.get("paths")):
                src, dst = str(path.get("src", "")), str(path.get("dst", ""))
                for stat, key in _OWD_STATS:
                    if (v := _num(path.get(key))) is not None:
                        owd.add_metric([src, dst, stat], v * _US)
                if (v := _num(path.get("loss"))) is not None:
                    loss.add_metric([src, dst], v)
                if (v := _num(path.get("jitter_us"))) is not None:
                    jitter.add_metric([src, dst], v * _US)
                verdict = path.get("verdict")
                if isinstance(verdict, Mapping) and isinstance(verdict.get("bad"), bool):
                    bad.add_metric([src, dst], 1.0 if verdict["bad"] else 0.0)
            reference = str(snap.get("reference") or "")
            clock = snap.get("clock")
            for node, est in clock.items() if isinstance(clock, Mapping) else ():
                if not isinstance(est, Mapping):
                    continue
                if (v := _num(est.get("offset_us"))) is not None:
                    offset.add_metric([str(node), reference], v * _US)
                if (v := _num(est.get("uncertainty_us"))) is not None:
                    uncertainty.add_metric([str(node)], v * _US)
            if (v := _num(snap.get("loop_residual_us"))) is not None:
                residual.add_metric([], v * _US)
            for sus in _dicts(snap.get("suspects")):
                if (conf := _num(sus.get("confidence"))) is None:
                    continue
                kinds = sus.get("kinds") or ()
                labels = [
                    str(sus.get("link", "")),
                    str(sus.get("nic") or ""),
                    str(sus.get("direction", "")),
                    ",".join(sorted(str(k) for k in kinds)) if isinstance(kinds, list | tuple) else str(kinds),
                ]
                suspect.add_metric(labels, conf)
            raw = snap.get("counters")
            raw = raw if isinstance(raw, Mapping) else {}
            for family, (_, key, _) in zip(counters, _COUNTERS, strict=True):
                if (v := _num(raw.get(key))) is not None:
                    family.add_metric([], v)

        yield from (enabled, stamp, owd, loss, jitter, bad, offset, uncertainty, residual, suspect, *counters)


def make_registry(snapshot: SnapshotSource) -> CollectorRegistry:
    """A private registry holding only the Lens collector for ``snapshot``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LensCollector(snapshot))
    return registry


def render_text(snapshot: Snapshot | None) -> str:
    """The Prometheus text exposition of one snapshot (for tests, the CLI and debugging)."""
    return generate_latest(make_registry(lambda: snapshot)).decode()


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per request: a slow scraper must not hold up the next one."""

    daemon_threads = True


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: a scrape every 15 s would flood the daemon's output."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """Serves ``/metrics`` over HTTP from a daemon thread, for as long as the daemon runs.

    A small wsgiref server rather than ``prometheus_client.start_http_server``: the latter returns
    no handle to close on older client versions, and the daemon (and its tests) must be able to stop
    it and release the port. ``port=0`` binds a free port; :attr:`port` tells which after
    :meth:`start`. ``bind`` may be an IPv4 or IPv6 address, or empty for every IPv4 address.
    """

    def __init__(self, snapshot: SnapshotSource, bind: str, port: int) -> None:
        self.registry = make_registry(snapshot)
        self._bind = bind
        self._requested_port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def bind(self) -> str:
        """The address served on, as given ("" for every IPv4 address)."""
        return self._bind

    @property
    def port(self) -> int:
        """The bound TCP port (the requested one until :meth:`start`)."""
        if self._server is None:
            return self._requested_port
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Bind and serve. Raises OSError when the address cannot be bound (the caller reports why)."""
        if self._server is not None:
            return
        server_class = _ThreadingWSGIServer6 if ":" in self._bind else _ThreadingWSGIServer
        app = make_wsgi_app(self.registry)
        self._server = make_server(
            self._bind, self._requested_port, app, server_class=server_class, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="lens-metrics", daemon=True
        )
        self._thread.start()
        log.info("Fleet Lens metrics on http://%s:%d/metrics", self._bind or "0.0.0.0", self.port)

    def close(self) -> None:
        """Stop serving and release the port; safe to call twice or before :meth:`start`."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
