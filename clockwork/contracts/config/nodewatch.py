"""The node watch's configuration: the ``[nodewatch]`` section of clockwork.toml (one documented dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from clockwork.contracts.config.fields import setting
from clockwork.contracts.errors import ConfigError

__all__ = ["NodeWatchConfig"]


@dataclass(frozen=True)
class NodeWatchConfig:
    """Node-silent verdicts: a peer silent on every rail whose kernel is silent too is lost, and its jobs told."""

    enabled: bool = setting(
        True,
        "Judge peers that fall silent on every fabric rail (needs LinkPass, whose heartbeats are the evidence) and "
        "tell the TorchPass jobs that ran on them at once. Off: a crashed node is found by TorchPass's own "
        "heartbeats only (agent_timeout_s, 2 s by default).",
    )
    silent_after_ms: int = setting(
        100,
        "A peer whose daemon has not been heard on any rail for this long, and whose kernel has not answered an "
        "ICMP echo on any rail for the last (silent_after_ms - probe_after_ms), is judged silent, milliseconds.",
        min=20,
    )
    probe_after_ms: int = setting(
        30,
        "After this long without a heartbeat on any rail, the peer's kernel is probed with an ICMP echo on every "
        "rail at each tick: a node whose processes are stopped or starved still answers from its kernel, a dead "
        "one does not. Must be below silent_after_ms, milliseconds.",
        min=1,
    )
    max_own_gap_ms: int = setting(
        50,
        "This daemon's own loop must have run at least this often over the silence it judges: a longer gap "
        "(this node was starved or stopped) means it may simply not have listened, and the verdict waits for a "
        "clean window, milliseconds.",
        min=1,
    )
    confirm_timeout_ms: int = setting(
        100,
        "How long one second observer (another node's daemon, asked over the CURVE daemon-to-daemon socket) may "
        "take to answer before the next one is asked, milliseconds.",
        min=1,
    )
    echo_check_s: float = setting(
        30.0,
        "How often each heard peer's kernel is checked to answer ICMP echo at all, seconds. A peer that never "
        "answered one cannot be told apart from a starved node: no verdict is made about it (status says so).",
        min=1.0,
    )

    def __post_init__(self) -> None:
        if self.probe_after_ms >= self.silent_after_ms:
            raise ConfigError(
                f"[nodewatch] probe_after_ms: invalid value {self.probe_after_ms} (expected less than silent_after_ms "
                f"= {self.silent_after_ms}: the kernel must be probed for a while before the verdict)"
            )
