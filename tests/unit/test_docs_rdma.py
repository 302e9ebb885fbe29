"""docs/linkpass.md's "RDMA and NCCL" says what the code does: the variables it names as set are the ones the
code path sets, the NCCL version and the setting it names are the code's, the files it points to exist.

The section once described an ``NCCL_IB_HCA`` exclusion that no code made; this test keeps it from drifting
again.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from clockwork.contracts.config.health import HealthConfig
from torchpass import fabric_env
from torchpass.fabric_env import fabric_environment

REPO = Path(__file__).resolve().parents[2]
NOT_SET = {"NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_NET_FORCE_MERGE"}  # the doc says TorchPass sets none


def section() -> str:
    text = (REPO / "docs" / "linkpass.md").read_text()
    start = text.index("## RDMA and NCCL")
    return text[start : text.index("\n## ", start + 1)]


def test_the_variables_the_doc_says_are_set_are_the_ones_the_code_sets() -> None:
    doc = section()
    named = set(re.findall(r"\b(?:NCCL|GLOO)_[A-Z_]+\b", doc))
    assert "TorchPass does not set these" in doc and NOT_SET <= named
    said_set = named - NOT_SET
    produced = fabric_environment({}, {"mlx5_3": "ib3 down"}, "10.0.0.1", {"cw0": ["10.0.0.1"]}).env
    assert said_set == set(produced) | {fabric_env.NCCL_PORT_FAILOVER}
    assert produced == {"NCCL_IB_HCA": "^mlx5_3", "NCCL_SOCKET_IFNAME": "=cw0", "GLOO_SOCKET_IFNAME": "cw0"}
    assert "NCCL_IB_HCA=^mlx5_3" in doc and "NCCL_SOCKET_IFNAME==DEV" in doc


def test_the_nccl_versions_and_the_setting_are_the_codes() -> None:
    doc = section()
    floor = ".".join(map(str, fabric_env.PORT_FAILOVER_MIN))
    assert f"| {floor} and later |" in doc
    assert fabric_env.nccl_path(fabric_env.PORT_FAILOVER_MIN).port_failover
    fields = {f.name: f.default for f in dataclasses.fields(HealthConfig)}
    assert "hca_down_move_s" in doc and fields["hca_down_move_s"] == 1.0 and "(1 s; 0 = never)" in doc
    assert "/sys/class/net/<netdev>/device/infiniband/<hca>" in doc
    hca_code = (REPO / "linkpass" / "hca.py").read_text()
    assert '"class" / "net" / netdev / "device" / "infiniband"' in hca_code


def test_the_files_the_doc_names_exist() -> None:
    for path in re.findall(r"`((?:linkpass|torchpass|tests)/[\w/]+\.py)`|\((tests/[\w/]+\.py)\)", section()):
        name = path[0] or path[1]
        assert (REPO / name).is_file(), name
