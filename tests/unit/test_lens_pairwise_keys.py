"""Fleet Lens with a key pair per node: probes, trains and summaries are accepted under pairwise keys, a node
cannot send them as another, and a node changes its key pair while Lens runs without one packet refused.

Three real Lens instances (C pacer and receiver) over loopback addresses, as tests/unit/test_lens_prober_loopback.py
runs them, each with its own key folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from clockwork.contracts.config.lens import LensConfig
from clockwork.contracts.curve_keys import generate
from clockwork.contracts.pairwise_keys import NEXT_SUFFIX, PREVIOUS_SUFFIX, PairwiseKeys
from clockworkd.lens import wire
from clockworkd.lens.keys import LensKeys
from clockworkd.lens.prober import Lens
from clockworkd.lens.topology import Topology
from linkpass.fabric import FabricMap

IPS = {"n1": "127.0.0.21", "n2": "127.0.0.22", "n3": "127.0.0.23"}
INDEX = {name: i for i, name in enumerate(sorted(IPS))}
LABEL = b"clockwork-lens"
WAIT_S = 30.0


def install(root: Path) -> dict[str, Path]:
    made = root / "made"
    for node in IPS:
        generate(made, node)
    folders = {}
    for node in IPS:
        folder = root / node
        folder.mkdir()
        for other in IPS:
            shutil.copy(made / f"{other}.key", folder / f"{other}.key")
        shutil.copy(made / f"{node}.key_secret", folder / f"{node}.key_secret")
        (folder / f"{node}.key_secret").chmod(0o600)
        folders[node] = folder
    return folders


def keys_of(folders: dict[str, Path], node: str) -> PairwiseKeys:
    return PairwiseKeys(LABEL, folders[node] / f"{node}.key_secret", folders[node], [n for n in IPS if n != node])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((IPS["n1"], 0))
        return int(s.getsockname()[1])


@contextmanager
def cluster(folders: dict[str, Path]) -> Iterator[tuple[LensConfig, dict[str, Lens]]]:
    if os.geteuid() != 0:
        pytest.fail("Lens binds its probe sockets to a device (SO_BINDTODEVICE), which needs root")
    cfg = LensConfig(
        port=free_port(), interval_ms=10, train_interval_ms=200, evaluate_ms=100, summary_ms=100, window_s=1.0
    )
    fabric = FabricMap.parse({"nodes": {n: {"addr": ip, "nics": {"lo": ip}} for n, ip in IPS.items()}})
    topology = Topology.from_fabric(fabric)
    lenses = {n: Lens(cfg, n, fabric, topology, keys_of(folders, n), lambda k, f: None) for n in IPS}
    try:
        for lens in lenses.values():
            lens.start()
        yield cfg, lenses
    finally:
        for lens in lenses.values():
            lens.close()


def drive(lenses: dict[str, Lens], until: Callable[[], bool]) -> bool:
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        for lens in lenses.values():
            lens.tick()
        if until():
            return True
        time.sleep(0.001)
    return False


def received(lenses: dict[str, Lens]) -> dict[str, tuple[int, int]]:
    return {n: (lens.counters["probes_received"], lens.counters["summaries_received"]) for n, lens in lenses.items()}


def more_than(lenses: dict[str, Lens], before: dict[str, tuple[int, int]]) -> Callable[[], bool]:
    """Every Lens has received more probes and summaries than ``before``."""

    def check() -> bool:
        now = received(lenses)
        return all(now[n][0] > before[n][0] + 50 and now[n][1] > before[n][1] for n in lenses)

    return check


def test_pairwise_keys_carry_probes_and_refuse_a_node_speaking_for_another(tmp_path: Path) -> None:
    folders = install(tmp_path)
    with cluster(folders) as (cfg, lenses):
        zero = dict.fromkeys(IPS, (0, 0))
        assert drive(lenses, more_than(lenses, zero)), received(lenses)
        assert {n: lens.counters["rejected"] for n, lens in lenses.items()} == dict.fromkeys(IPS, 0)

        # n3 knows its own keys only: a probe and a summary that claim to be n2's, sent from n2's address
        # (spoofed) and from n3's own, under the key n3 has with n1.
        n3_keys = LensKeys(sorted(IPS), "n3", keys_of(folders, "n3"))
        probe = wire.header(wire.PROBE, 0, (INDEX["n2"], 0), (INDEX["n1"], 0), 10**6, time.time_ns(), 1)
        summary = wire.header(wire.SUMMARY, 0, (INDEX["n2"], 0), (INDEX["n1"], 0), 10**6, 0, 1, 2)
        forged = [wire.sign(n3_keys.send_key("n1"), probe), wire.sign(n3_keys.send_key("n1"), summary, b"\x90\x90")]
        before = lenses["n1"].counters["rejected"]
        for src in (IPS["n2"], IPS["n3"]):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((src, 0))
                for packet in forged:
                    s.sendto(packet, (IPS["n1"], cfg.port))
        assert drive(lenses, lambda: lenses["n1"].counters["rejected"] >= before + 4), lenses["n1"].counters
        assert lenses["n1"].counters["rejected"] == before + 4


def test_a_node_changes_its_key_pair_while_lens_runs(tmp_path: Path) -> None:
    folders = install(tmp_path)
    generate(tmp_path / "new", "n2")
    new_public, new_secret = tmp_path / "new" / "n2.key", tmp_path / "new" / "n2.key_secret"
    secret2 = folders["n2"] / "n2.key_secret"
    previous2 = Path(str(secret2) + PREVIOUS_SUFFIX)

    def next_public_everywhere() -> None:
        for node in ("n1", "n3"):
            shutil.copy(new_public, folders[node] / f"n2{NEXT_SUFFIX}")

    def n2_switches() -> None:
        shutil.copy(secret2, previous2)
        previous2.chmod(0o600)
        shutil.copy(new_secret, secret2)
        secret2.chmod(0o600)
        shutil.copy(new_public, folders["n2"] / "n2.key")

    def new_public_current() -> None:
        for node in ("n1", "n3"):
            shutil.copy(new_public, folders[node] / "n2.key")
            (folders[node] / f"n2{NEXT_SUFFIX}").unlink()

    def old_secret_gone() -> None:  # only once every node took step 3: they send to n2 under its new key now
        previous2.unlink()

    with cluster(folders) as (_cfg, lenses):
        assert drive(lenses, more_than(lenses, dict.fromkeys(IPS, (0, 0)))), received(lenses)
        steps = (next_public_everywhere, n2_switches, new_public_current, old_secret_gone)
        for step, change in enumerate(steps):
            versions = {n: lens.keys.keys.version for n, lens in lenses.items()}  # type: ignore[union-attr]
            change()
            changed = ("n2",) if change in (n2_switches, old_secret_gone) else ("n1", "n3")

            def reloaded(changed: tuple[str, ...] = changed, versions: dict[str, Any] = versions) -> bool:
                return all(lenses[n].keys.keys.version > versions[n] for n in changed)  # type: ignore[union-attr]

            assert drive(lenses, reloaded), step
            before = received(lenses)
            assert drive(lenses, more_than(lenses, before)), (step, received(lenses))
            rejected = {n: lens.counters["rejected"] for n, lens in lenses.items()}
            assert rejected == dict.fromkeys(IPS, 0), (step, rejected)
