"""The budgets' arithmetic (torchpass.rank.budgets), with the readings injected; the readings themselves from real
/proc/meminfo and statvfs; the job's verdict carried through a real c10d store; the sizes, the settings and the
site's snapshot policy.

The worked example is the user guide's: a 70B-parameter model trained with bf16 parameters, fp32 master weights
and Adam's two fp32 moments (16 bytes per parameter) over 8 nodes of 8 H200s in pure FSDP, on nodes with 2 TiB
of memory, 1 TiB of /dev/shm (half the memory, Linux's default) and a 1 PiB filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from clockwork.contracts.config.snapshots import SnapshotSiteConfig, parse_size
from clockwork.contracts.errors import ConfigError as SiteConfigError
from torchpass.config import ConfigError, TorchPassConfig
from torchpass.launch.site_policy import apply_site_policy
from torchpass.rank.budgets import (
    PEER_COPIES,
    SNAPSHOTS,
    JobVerdict,
    NodeReadings,
    RankUse,
    judge,
    mem_available,
    read_node,
    size_text,
)

GiB, TiB = 1 << 30, 1 << 40
NODES, GPUS = 8, 8
SHARD = 70_000_000_000 * 16 // (NODES * GPUS)  # 17.5 GB per GPU: bf16 + fp32 master + 2 fp32 moments
H200 = NodeReadings(mem_available=2 * TiB - 200 * GiB, shm_free=TiB, snapshot_free=1 << 50)


def _job(readings: NodeReadings = H200, *, arena: int = 0, copies: int = 0) -> list[RankUse]:
    """Every rank of the 70B job: a node's 8 ranks share its readings."""
    state = SHARD if copies else 0
    return [
        RankUse(f"gpu{n:02d}", readings, arena=arena, shard_file=arena, state=state, copies=copies)
        for n in range(NODES)
        for _ in range(GPUS)
    ]


def test_the_70b_job_fits_an_h200_node_with_every_feature() -> None:
    """Staging 8 x 17.5 GB = 140 GB of /dev/shm; peer copies 8 x 5 x 17.5 GB = 700 GB; together 840 GB of 1.8 TiB;
    snapshots 4 x 1.12 TB on disk."""
    verdict = judge(_job(arena=SHARD, copies=5), keep=3, quota=0, policy="refuse")
    assert not verdict.refuse and not verdict.shortfalls and verdict.off == frozenset()


def test_a_quota_too_small_for_the_snapshots_refuses_naming_the_setting() -> None:
    verdict = judge(_job(arena=SHARD, copies=5), keep=3, quota=4 * TiB, policy="refuse")
    assert verdict.refuse and verdict.off == frozenset()
    (short,) = verdict.shortfalls
    assert (short.feature, short.where, short.needed, short.available) == (
        SNAPSHOTS,
        "under the snapshot quota",
        4 * SHARD * NODES * GPUS,
        4 * TiB,
    )
    message = verdict.message()
    expected = (
        "snapshots: 4.07 TiB needed, 4.00 TiB available under the snapshot quota (snapshot_keep = 3 snapshots and "
        "the one being written, 1.02 TiB each)"
    )
    assert expected in message, message
    assert "snapshot_quota" in message and "budget_policy = degrade" in message, message


def test_200_gb_per_gpu_fits_neither_shm_nor_memory_and_degrade_trains_without() -> None:
    """8 x 200 GB of staging is 1.6 TB against 1 TiB of /dev/shm, and peer copies (5 x 200 GB per GPU) 8 TB against
    1.8 TiB: refused with both numbers; degraded, both are switched off."""
    big = 200_000_000_000
    uses = [RankUse(f"n{n}", H200, arena=big, shard_file=big, state=big, copies=5) for n in range(2) for _ in range(8)]
    refused = judge(uses, keep=3, quota=0, policy="refuse")
    assert refused.refuse
    found = {(s.feature, s.where): (s.needed, s.available, s.nodes) for s in refused.shortfalls}
    assert found[(SNAPSHOTS, "in /dev/shm")] == (8 * big, TiB, ("n0", "n1"))  # one line for both nodes
    assert found[(PEER_COPIES, "in host memory")] == (8 * 5 * big, H200.mem_available, ("n0", "n1"))
    assert "available in /dev/shm on n0 (and 1 other node) (8 rank(s) x a staging arena" in refused.message()
    degraded = judge(uses, keep=3, quota=0, policy="degrade")
    assert not degraded.refuse and degraded.off == {SNAPSHOTS, PEER_COPIES}
    assert degraded.message().startswith("training without peer_copies and snapshots")


def test_200_gb_per_gpu_stages_through_the_default_arena_cap_and_fits_dev_shm() -> None:
    """With snapshot_arena_max's default (32 GiB), 8 ranks of 200 GB stage through 8 x 32 GiB = 256 GiB of /dev/shm
    (of 1 TiB): the snapshots fit the node; only the disk and the quota see the whole 200 GB per rank."""
    big = 200_000_000_000
    cap = parse_size(TorchPassConfig().snapshot_arena_max, "snapshot_arena_max")
    uses = [RankUse(f"n{n}", H200, arena=min(big, cap), shard_file=big) for n in range(2) for _ in range(8)]
    assert cap == 32 * GiB
    verdict = judge(uses, keep=3, quota=0, policy="refuse")
    assert not verdict.shortfalls, verdict.message()
    short = judge(uses, keep=3, quota=10 * TiB, policy="refuse").shortfalls  # 4 x 16 x 200 GB = 11.6 TiB
    assert [(s.feature, s.where) for s in short] == [(SNAPSHOTS, "under the snapshot quota")]


def test_memory_shared_by_both_goes_to_the_peer_copies() -> None:
    """Each fits alone; together they do not: snapshots give way, peer copies stay."""
    tight = NodeReadings(mem_available=800 * GiB, shm_free=TiB, snapshot_free=1 << 50)
    shard = 17 * GiB
    uses = [RankUse("n0", tight, arena=shard, shard_file=shard, state=shard, copies=5) for _ in range(8)]
    verdict = judge(uses, keep=1, quota=0, policy="degrade")
    assert verdict.off == {SNAPSHOTS}
    (short,) = verdict.shortfalls
    assert (short.where, short.nodes, short.needed) == ("in host memory", ("n0",), 8 * 6 * shard)


def test_when_peer_copies_go_anyway_snapshots_keep_the_memory_they_would_have_shared() -> None:
    """Node a fits its copies, but not its copies and its staging together; node b does not fit its copies at all.
    Peer copies go (node b), so node a's staging fits after all: only peer copies are switched off."""
    a = NodeReadings(mem_available=100 * GiB, shm_free=TiB, snapshot_free=1 << 50)
    b = NodeReadings(mem_available=40 * GiB, shm_free=TiB, snapshot_free=1 << 50)
    uses = [
        RankUse("a", a, arena=30 * GiB, shard_file=GiB, state=10 * GiB, copies=8),
        RankUse("b", b, arena=30 * GiB, shard_file=GiB, state=10 * GiB, copies=5),
    ]
    verdict = judge(uses, keep=3, quota=0, policy="degrade")
    assert verdict.off == {PEER_COPIES}, verdict.message()
    assert [(s.where, s.nodes) for s in verdict.shortfalls] == [("in host memory", ("b",))]


def test_the_snapshot_filesystem_counts_what_the_job_already_holds_there() -> None:
    """A requeued job: its old snapshots are removed as the new ones come (retention), so they count as free."""
    disk = NodeReadings(mem_available=TiB, shm_free=TiB, snapshot_free=3 * GiB, snapshot_used=2 * GiB)
    uses = [RankUse("n0", disk, arena=GiB, shard_file=GiB)]
    assert not judge(uses, keep=3, quota=0, policy="refuse").shortfalls  # 4 GiB needed, 3 + 2 there
    (short,) = judge(uses, keep=5, quota=0, policy="refuse").shortfalls
    assert (short.where, short.needed, short.available) == ("on the snapshot filesystem", 6 * GiB, 5 * GiB)


def test_unknown_readings_are_not_judged() -> None:
    blind = NodeReadings(mem_available=None, shm_free=None, snapshot_free=None)
    assert not judge(
        [RankUse("n0", blind, arena=1 << 50, shard_file=1, state=1 << 50, copies=5)], keep=3, quota=0, policy="refuse"
    ).shortfalls


def test_readings_of_this_machine(tmp_path: Path) -> None:
    """The seam's real side: /proc/meminfo and statvfs of /dev/shm and of the snapshot folder's nearest parent."""
    readings = read_node(tmp_path / "snapshots" / "42", count_snapshots=True)
    assert readings.mem_available is not None and readings.mem_available > 0
    st = os.statvfs(tmp_path)
    assert readings.snapshot_free is not None and abs(readings.snapshot_free - st.f_bavail * st.f_frsize) < 1 << 30
    assert readings.shm_free is not None and readings.snapshot_used == 0
    step = tmp_path / "snapshots" / "42" / "step-0000000001"
    step.mkdir(parents=True)
    (step / "rank-00000.h5").write_bytes(b"x" * 5000)
    assert read_node(tmp_path / "snapshots" / "42", count_snapshots=True).snapshot_used == 5000
    assert mem_available("MemTotal: 10 kB\nMemAvailable:   2048 kB\n") == 2 * 1024 * 1024


def test_readings_through_the_seam(tmp_path: Path) -> None:
    class Fs:
        f_bavail, f_frsize = 10, 4096

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 4 kB\n")
    readings = read_node(tmp_path / "none", meminfo=meminfo, shm=tmp_path, statvfs=lambda _path: Fs())
    assert readings == NodeReadings(mem_available=4096, shm_free=40960, snapshot_free=40960)


def test_the_verdict_reaches_newcomers_through_the_store() -> None:
    store = dist.HashStore()
    undecided, decided = JobVerdict(), JobVerdict()
    undecided.publish(store)  # nothing to say
    assert not store.check([JobVerdict.KEY])
    decided.decide(frozenset({SNAPSHOTS}))
    decided.publish(store)
    newcomer = JobVerdict()
    newcomer.adopt(store)
    assert newcomer.decided and newcomer.off == {SNAPSHOTS}
    fits, later = JobVerdict(), dist.HashStore()
    fits.decide(frozenset())
    fits.publish(later)
    newcomer = JobVerdict()
    newcomer.adopt(later)
    assert newcomer.decided and newcomer.off == frozenset()


# ----- sizes and settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("", 0),
        ("0", 0),
        ("1024", 1024),
        ("500G", 500 * GiB),
        ("1.5T", 3 * TiB // 2),
        ("800GiB", 800 * GiB),
        ("2k", 2048),
    ],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text, "x") == value


def test_bad_sizes_name_the_setting() -> None:
    with pytest.raises(SiteConfigError, match=r"\[snapshots\] quota: invalid size '5 apples'"):
        SnapshotSiteConfig(quota="5 apples")
    with pytest.raises(ConfigError, match="snapshot_quota: invalid size 'lots'"):
        TorchPassConfig(snapshot_quota="lots")
    with pytest.raises(ConfigError, match="budget_policy"):
        TorchPassConfig().with_assignment("budget_policy=maybe")
    assert size_text(1536) == "1.50 KiB" and size_text(12) == "12 B"


def test_the_sites_snapshot_root_and_quota(tmp_path: Path) -> None:
    """The admin's [snapshots] section: the root is the default folder, below what the job says; the quota a
    ceiling the job may only lower. Environment beats the file, as for every Clockwork setting."""
    site = tmp_path / "clockwork.toml"
    site.write_text('[snapshots]\nroot = "/lustre/snaps"\nquota = "10T"\n')
    env = {"CLOCKWORK_CONFIG": str(site), "SLURM_JOB_USER": "ada"}
    cfg = apply_site_policy(TorchPassConfig(), env)
    assert cfg.snapshot_dir == "/lustre/snaps/ada/{job}" and cfg.snapshot_quota == "10T"
    own = apply_site_policy(TorchPassConfig(snapshot_dir="/scratch/mine", snapshot_quota="1T"), env)
    assert own.snapshot_dir == "/scratch/mine" and own.snapshot_quota == "1T"
    assert apply_site_policy(TorchPassConfig(snapshot_quota="50T"), env).snapshot_quota == "10T"
    assert apply_site_policy(TorchPassConfig(), dict(env, CLOCKWORK_SNAPSHOTS_QUOTA="2T")).snapshot_quota == "2T"
    site.write_text("[snapshots]\nquota_tb = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'quota_tb' in \\[snapshots\\]"):
        apply_site_policy(TorchPassConfig(), env)
    with pytest.raises(ConfigError, match="failure_domains: cannot read"):
        apply_site_policy(TorchPassConfig(failure_domains=str(tmp_path / "no.map")), {})


def test_an_arena_larger_than_dev_shm_is_refused_before_any_byte_is_written() -> None:
    """tmpfs allocates on write: an arena past /dev/shm's free space would die of SIGBUS mid-copy. It is refused
    when made, with the numbers (the snapshotter then fails that snapshot only)."""
    import errno

    from torchpass.snapshot.arena import SharedArena

    st = os.statvfs("/dev/shm")
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError) as info:
        SharedArena(st.f_bavail * st.f_frsize + (1 << 30), cuda=False)
    assert info.value.errno == errno.ENOSPC and "/dev/shm has" in str(info.value)
    assert set(os.listdir("/dev/shm")) == before
    arena = SharedArena(4096, cuda=False)
    arena.close()


def test_the_staging_counted_is_the_arena_cap_not_the_share(tmp_path: Path) -> None:
    """A share larger than snapshot_arena_max is staged through an arena of the cap: that is what /dev/shm and
    memory are asked for; the shard file on disk is still the whole share."""
    import logging
    from types import SimpleNamespace

    from tests.unit.test_snapshot_store import Trainer
    from torchpass.config import TorchPassConfig
    from torchpass.rank.budget_gate import measure
    from torchpass.snapshot import Snapshotter

    trainer = Trainer(width=256)
    uses = {}
    for cap in ("0", "64K"):
        cfg = TorchPassConfig(snapshot_dir=str(tmp_path), snapshot_every_steps=1, snapshot_arena_max=cap)
        host = SimpleNamespace(config=cfg, parts=trainer.parts, slot=0, world_size=1, committed_step=-1)
        snaps = Snapshotter(cfg, logging.LoggerAdapter(logging.getLogger("test"), {}), None)
        uses[cap] = measure(host, snaps, None)  # type: ignore[arg-type]
    whole, capped = uses["0"], uses["64K"]
    assert whole.arena == whole.shard_file > 10 * 65536, whole
    assert (capped.arena, capped.shard_file) == (65536, whole.shard_file), capped
