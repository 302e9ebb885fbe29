"""Pure-Python hostlist expansion, checked against what `scontrol show hostnames` (22.05.8) prints."""

from __future__ import annotations

import pytest

from clockwork.contracts.hostlist import MAX_HOSTS, expand_hostlist

# Expected values were produced with Slurm 22.05.8: `scontrol show hostnames EXPR`.
SCONTROL_GOLDEN = [
    ("n[01-03],gpu01", ["n01", "n02", "n03", "gpu01"]),
    ("a[1-2]b[01-02]", ["a1b01", "a1b02", "a2b01", "a2b02"]),
    ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    ("n[1-2]-m[1-2]", ["n1-m1", "n1-m2", "n2-m1", "n2-m2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[00-02]", ["n00", "n01", "n02"]),
    ("n[1-010]", ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"]),
    ("n[01-1]", ["n01"]),
    ("n0[1-3]", ["n01", "n02", "n03"]),
    ("x[1,3-4]", ["x1", "x3", "x4"]),
    ("n[001-003,10]", ["n001", "n002", "n003", "n10"]),
    ("n[1-3,2]", ["n1", "n2", "n3", "n2"]),
    ("n1,n1", ["n1", "n1"]),
    ("rack1-n[1-2],rack2-n[3]", ["rack1-n1", "rack1-n2", "rack2-n3"]),
    ("n[1-2] m[1-2]", ["n1", "n2", "m1", "m2"]),
    ("n[1-2],,m1", ["n1", "n2", "m1"]),
    (",n1", ["n1"]),
    ("n[0]", ["n0"]),
    ("a.b[1-2]", ["a.b1", "a.b2"]),
    ("node-1,node-2", ["node-1", "node-2"]),
    ("N[1-2]", ["N1", "N2"]),
    ("gpu7", ["gpu7"]),
]


@pytest.mark.parametrize(("expr", "expected"), SCONTROL_GOLDEN)
def test_matches_scontrol(expr: str, expected: list[str]) -> None:
    assert expand_hostlist(expr) == expected


def test_empty_expression_is_no_hosts() -> None:
    assert expand_hostlist("") == []
    assert expand_hostlist("  ,  ") == []


def test_suffix_after_bracket_is_kept() -> None:
    # Slurm 22.05 rejects this form; accepting it is a documented superset.
    assert expand_hostlist("n[1-2]-ib") == ["n1-ib", "n2-ib"]


@pytest.mark.parametrize(
    "expr",
    [
        "n[2-1]",  # descending
        "n[a-b]",  # not numbers
        "n[1-3",  # unclosed
        "n1]",  # unbalanced
        "n[1-10:2]",  # step syntax (scontrol 22.05 rejects it too)
        "n[[1-2]]",  # nested
        "n[,1]",  # empty element
        "n[1,]",
        "n[-1]",
        "n[1-]",
        "n[]",
        "n[ 1-2]",  # whitespace inside brackets
    ],
)
def test_malformed_raises(expr: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(expr)


def test_huge_expansion_is_refused() -> None:
    with pytest.raises(ValueError, match=str(MAX_HOSTS)):
        expand_hostlist("n[0-999999999]")
    with pytest.raises(ValueError, match=str(MAX_HOSTS)):
        expand_hostlist("a[0-9999]b[0-9999]")


def test_large_but_allowed_expansion() -> None:
    hosts = expand_hostlist("n[00000-19999]")
    assert len(hosts) == 20000
    assert hosts[0] == "n00000"
    assert hosts[-1] == "n19999"
