"""The node watch with bounded heartbeats: it heartbeats the nodes of the jobs running here, and asks their other
nodes first about a suspect (only they heartbeat it; a path peer of this node may never have heard it)."""

from __future__ import annotations

from pathlib import Path

from clockwork.contracts.config.nodewatch import NodeWatchConfig
from clockworkd.nodewatch.echo import EchoProber
from clockworkd.nodewatch.judge import Judge
from clockworkd.nodewatch.watch import NodeWatch
from clockworkd.registry import RUNNING, JobRecord
from linkpass.engine import LinkPass
from linkpass.fabric import FabricMap
from linkpass.settings import LinkPassConfig

TICK = 0.01
CFG = NodeWatchConfig()
WALL0 = 1_000_000.0


def test_a_suspect_is_asked_about_to_the_nodes_that_share_its_job_first() -> None:
    judge = Judge(CFG, "n1", TICK)
    peers = ("a", "b", "c", "mate", "suspect")
    heard = dict.fromkeys(peers, 100.0)
    now = 100.0
    asked: list[tuple[str, list[str]]] = []
    judge.mates = {"suspect": {"mate", "n1"}}
    while now < 101.3:
        now += TICK
        for peer in peers:
            if peer != "suspect" or now < 101.0:
                heard[peer] = now
        step = judge.tick(now, WALL0 + now, heard, True)
        for peer in step.echo:
            if peer != "suspect" or now < 101.0:
                judge.echo_reply(peer, now)
        asked += step.ask
    assert asked and asked[0][0] == "suspect" and asked[0][1][0] == "mate", asked


def test_the_node_watch_heartbeats_the_nodes_of_the_running_jobs_here(tmp_path: Path) -> None:
    nodes = {
        f"n{i}": {"addr": f"10.0.0.{i}", "nics": {"ib0": f"10.1.0.{i}", "ib1": f"10.2.0.{i}"}} for i in range(1, 9)
    }
    fab = FabricMap.parse({"nodes": nodes})
    linkpass = LinkPass(LinkPassConfig(random_peers=0), "n1", fab, b"k" * 32, lambda kind, fields: None)
    jobs = [
        JobRecord(7, 1000, "u", ("n1", "n5", "n6"), {}, RUNNING, 0.0),
        JobRecord(8, 1000, "u", ("n3", "n4"), {}, RUNNING, 0.0),  # not on this node
    ]
    watch = NodeWatch(CFG, linkpass, EchoProber({}), None, jobs=lambda: jobs, record=lambda *a: None)
    watch.tick()
    assert linkpass.watch_peers == {"n5", "n6"}
    assert watch.judge.mates["n5"] == {"n1", "n5", "n6"}
    jobs.clear()
    watch.tick()
    assert linkpass.watch_peers == frozenset()
