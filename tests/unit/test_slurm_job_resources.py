"""A job's resources as a stand-in allocation asks for them again (clockwork.contracts.slurm.resources), read
from both ``squeue --json`` shapes Slurm printed (22.05 and 24.11, recorded in tests/unit/data/slurm) and from
``scontrol -o show job``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clockwork.contracts.slurm.cli_backend import parse_scontrol_record
from clockwork.contracts.slurm.resources import gres_per_node, parse_resources_json, parse_resources_scontrol

DATA = Path(__file__).parent / "data" / "slurm"


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_the_recorded_queues_give_account_qos_and_time_limit(version: str) -> None:
    doc = json.loads((DATA / version / "squeue.json").read_text())
    job_id = json.loads((DATA / version / "manifest.json").read_text())["jobs"]["running"]
    res = parse_resources_json(doc, job_id)
    assert res is not None and (res.account, res.qos, res.gres) == ("root", "normal", "")
    assert res.time_limit_s == 525600 * 60 and res.start_time > 1.7e9
    assert parse_resources_json(doc, 999_999) is None


@pytest.mark.parametrize(
    ("per_node", "alloc", "nodes", "expected"),
    [
        ("gres:gpu:8", "cpu=8,gres/gpu=16", 2, "gpu:8"),  # 22.05 spelling
        ("gres/gpu:h100:8,gres/nic:1", "", 2, "gpu:h100:8,nic:1"),  # 23.02+ spelling, typed, two GRES
        ("cpu:4", "cpu=8,node=2,gres/gpu=6", 2, "gpu:3"),  # --gpus=6 on 2 nodes: from the allocation
        ("", "cpu=8,node=2,gres/gpu=8,gres/gpu:h100=8", 2, "gpu:h100:4"),  # the typed name only
        ("", "node=2,gres/gpu=8,gres/gpu:a100=4,gres/gpu:h100=4", 2, "gpu:a100:2,gpu:h100:2"),  # two types
        ("", "cpu=8,node=3,gres/gpu=8", 3, ""),  # uneven: no per-node form
        ("", "cpu=8,node=2", 2, ""),
    ],
)
def test_gres_per_node(per_node: str, alloc: str, nodes: int, expected: str) -> None:
    assert gres_per_node(per_node, alloc, nodes) == expected


def test_scontrol_records_give_the_same() -> None:
    line = (
        "JobId=7 JobName=train UserId=bob(1000) Account=ml-team QOS=gold JobState=RUNNING TimeLimit=1-02:03:04 "
        "NumNodes=2 NumCPUs=8 TRES=cpu=8,node=2,billing=8,gres/gpu=16 TresPerNode=gres:gpu:8"
    )
    res = parse_resources_scontrol(parse_scontrol_record(line), 7, 1000.0)
    assert (res.account, res.qos, res.gres, res.time_limit_s) == ("ml-team", "gold", "gpu:8", 93784.0)
    assert res.remaining_s(1000.0 + 93784.0 - 90) == 90 and res.time_option_minutes(1000.0 + 93784.0 - 90) == 1
    unlimited = parse_resources_scontrol(parse_scontrol_record("JobId=7 TimeLimit=UNLIMITED NumNodes=1"), 7, 0.0)
    assert unlimited.time_limit_s is None and unlimited.time_option_minutes(5.0) is None
