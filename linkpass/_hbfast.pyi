"""Types of the C extension linkpass._hbfast (linkpass/csrc/_hbfast.c); see its docstrings."""

from collections.abc import Sequence

VERSION: int
TAG_BYTES: int
KEY_SLOTS: int
KEY_BYTES: int
BATCH: int

def send(port: int, key: bytes, batches: Sequence[tuple[int, bytes, Sequence[int], bytes]]) -> tuple[int, int]: ...
def receive(
    sockets: Sequence[tuple[int, bytes, int]],
    key: bytes,
    me: int,
    fingerprint: int,
    nodes: int,
    rails: int,
    max_batches: int,
) -> tuple[list[tuple[int, int, int, int, int, int, int]], list[tuple[int, str, int, int, int, int]], int]: ...
def tag(body: bytes, key: bytes, node: int, slot: int) -> bytes | None: ...
