"""TorchPass's one configuration object: every knob of the launcher, the coordinator and the ranks.

The launcher builds it (defaults, then ``--config FILE``, then ``--set KEY=VALUE``) and hands it to every
rank as JSON in ``TORCHPASS_CONFIG``, so the coordinator and all ranks always agree on timeouts and seeds.
A rank may override fields in :func:`torchpass.init`. Unknown keys are errors everywhere: a misspelt
timeout silently falling back to a default is exactly the kind of surprise a fault-tolerance layer must not
have. Fields are the project's one mechanism (:mod:`clockwork.contracts.config.fields`): ``setting()`` documents each
(``doc``, ``choices``, ``min``) and ``coerce()`` checks every value, for a file, ``--set`` or the code alike,
with the daemon's own messages.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from clockwork.contracts.config.fields import FieldValueError, coerce, setting
from clockwork.contracts.config.snapshots import parse_size
from clockwork.contracts.errors import ConfigError

__all__ = ["ENV_CONFIG", "ConfigError", "TorchPassConfig", "environment_settings", "parse_duration"]

ENV_CONFIG = "TORCHPASS_CONFIG"
# Set by the SPANK plugin (sbatch --clockwork-snapshot=20m); the SLURM_SPANK_/SPANK_ forms under --export=NONE.
SNAPSHOT_VARIABLES = ("CLOCKWORK_SNAPSHOT", "SLURM_SPANK_CLOCKWORK_SNAPSHOT", "SPANK_CLOCKWORK_SNAPSHOT")
SNAPSHOT_DIR_VARIABLE = "CLOCKWORK_SNAPSHOT_DIR"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, where: str) -> float:
    """Seconds of ``off`` (0), ``90s``, ``20m``, ``1h``, ``2d`` (the SPANK option's syntax) or a bare number of
    seconds; ConfigError naming ``where`` otherwise."""
    value = text.strip().lower()
    if value in ("off", "0", ""):
        return 0.0
    try:
        if value[-1] in _UNITS:
            seconds = float(value[:-1]) * _UNITS[value[-1]]
        else:
            seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(f"{where}: expected off or a duration like 90s, 20m, 1h; got {text!r}")
    return seconds


def environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Settings the job's environment gives (between the config file and the command line in precedence):
    the snapshot period from ``--clockwork-snapshot`` and ``CLOCKWORK_SNAPSHOT_DIR``."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name in SNAPSHOT_VARIABLES:
        if env.get(name):
            out["snapshot_interval_s"] = parse_duration(env[name], name)
            break
    if env.get(SNAPSHOT_DIR_VARIABLE):
        out["snapshot_dir"] = env[SNAPSHOT_DIR_VARIABLE]
    return out


@dataclass(frozen=True)
class TorchPassConfig:
    """Settings shared by the launcher, the per-job coordinator and every rank (see each field's doc)."""

    backend: str = setting(
        "gloo",
        "Collective backend: 'gloo' (CPU, tested here), 'nccl' (GPU; non-blocking communicators, aborted on "
        "failure), or 'auto' (nccl when CUDA is available, else gloo).",
        choices=("gloo", "nccl", "auto"),
    )
    seed: int = setting(
        0,
        "Base seed. Before every step each rank reseeds its RNGs from (seed, rank slot, step), so a replacement "
        "rank draws the same dropout masks as the rank it replaces without any RNG state being moved.",
    )
    reseed_python: bool = setting(True, "Also reseed Python's `random` module at every step boundary.")
    reseed_numpy: bool = setting(True, "Also reseed NumPy's global generator at every step boundary (if importable).")
    zygote: bool = setting(
        True,
        "Fork every rank, spare and replacement from one process that imported torch once, the local launcher's "
        "or, under Slurm, each node agent's (about 5 s of CPU each on a small node, and a replacement on a "
        "healthy node is warm in milliseconds); off = a fresh interpreter each.",
    )
    gc_freeze: bool = setting(
        True,
        "When a rank joins, hand every object alive then (torch's and the script's modules: ~300k objects) to "
        "gc.freeze: the collector's full passes stop walking them, so its pauses inside steps shrink and the "
        "process exits about a second sooner (the final collection skips them). Objects alive at that point "
        "are never reclaimed as cyclic garbage.",
    )
    collective_timeout_s: float = setting(
        30.0,
        "Timeout of every collective and point-to-point transfer (never the 30-minute default). A dead peer "
        "whose sockets close is seen at once; this bounds a silently hung peer.",
        min=0.1,
    )
    join_timeout_s: float = setting(
        300.0,
        "How long the members of a new generation wait for each other at the rendezvous (covers a spare "
        "building its model). Past it the generation counts as broken and the coordinator tries again.",
        min=0.1,
    )
    heartbeat_interval_s: float = setting(
        1.0, "How often each rank's control thread tells the coordinator it is alive.", min=0.01
    )
    heartbeat_timeout_s: float = setting(
        15.0,
        "The coordinator declares a rank dead when it has not been heard for this long (a hung or "
        "silently lost process; an exiting process is seen at once by the launcher).",
        min=0.1,
    )
    coordinator_timeout_s: float = setting(
        30.0,
        "A rank that has not heard the coordinator for this long gives up (exits with an error): in local mode "
        "the coordinator lives in the launcher, so this means the launcher is gone.",
        min=0.1,
    )
    rpc_timeout_s: float = setting(10.0, "Deadline of one short request to the coordinator.", min=0.1)
    agent_heartbeat_interval_s: float = setting(
        0.25, "Slurm mode: how often each node agent tells every other agent it is alive.", min=0.01
    )
    agent_timeout_s: float = setting(
        2.0,
        "Slurm mode: a node agent not heard for this long is lost, with every process it ran (a crashed node "
        "is silent, it sends no reset). If it was the leader, the lowest agent still heard takes over.",
        min=0.05,
    )
    agent_stall_timeout_s: float = setting(
        30.0,
        "Slurm mode: a node agent silent past agent_timeout_s is lost then only if a second agent does not hear it "
        "either and the node daemon does not hear its node on the fabric; otherwise (a stalled agent process on "
        "a live node, or a link only one agent lost) only after this long.",
        min=0.05,
    )
    fabric_verdicts: bool = setting(
        True,
        "Slurm mode: act on the node daemon's node-silent verdicts (a node silent on every fabric rail for about "
        "100 ms, its kernel silent to ICMP echo, a second daemon agreeing): its agent is lost at once, not after "
        "agent_timeout_s. It needs clockworkd with LinkPass on the nodes (without, the same as off). Off: only the "
        "agents' own heartbeats count.",
    )
    agent_startup_timeout_s: float = setting(
        60.0,
        "Slurm mode: how long the agents wait for a peer never heard from (srun starts them at slightly "
        "different times) before counting it lost.",
        min=0.1,
    )
    broken_grace_s: float = setting(
        2.0,
        "After a rank reports a broken collective, how long the coordinator waits for a death notice before it "
        "rebuilds the generation with the same members (a collective error with nobody dead).",
        min=0.0,
    )
    spare_timeout_s: float = setting(
        600.0, "How long a vacant slot may wait for a spare before the job is declared failed.", min=0.1
    )
    borrow_fallback: str = setting(
        "fail",
        "--clockwork-spares=borrow, when no node can be borrowed: 'fail' fails the job at once with the reason; "
        "'wait' waits for a standby spare (--spares) until spare_timeout_s.",
        choices=("fail", "wait"),
    )
    borrow_timeout_s: float = setting(
        120.0,
        "--clockwork-spares=borrow: how long one borrow (node daemon + Slurm preemption) may take before it "
        "counts as failed; keep it above the cluster's GraceTime and [borrow] timeout_s.",
        min=1.0,
    )
    max_failures: int = setting(
        32, "Member failures the job survives; one more fails the job (stops a crash loop).", min=0
    )
    max_resets: int = setting(
        3,
        "Rebuilds with the same members (a collective error, nobody dead) at one step before the job is declared "
        "failed, with that diagnosis: an error that survives that many rebuilds at the same step is not transient.",
        min=0,
    )
    requeue_on_loss: bool = setting(
        True,
        "Slurm mode, the last line of defence: when the job fails in a way new nodes and a snapshot can undo (no "
        "spare came, or every holder of some part of the state is gone) and a complete snapshot exists, the "
        "leading agent requeues the job (scontrol requeue); the requeued job restores that snapshot (restore="
        "'auto'). Off: the job fails with the reason and the snapshot to restart from.",
    )
    max_requeues: int = setting(
        3,
        "requeue_on_loss: requeues of one job (SLURM_RESTART_COUNT, whoever requeued it) after which a failure "
        "is final: a job that keeps losing its state is not put back in the queue forever.",
        min=0,
    )
    store_prefix: str = setting(
        "torchpass", "Key prefix in the rendezvous stores; each generation uses PREFIX/gN/ so none collide."
    )
    transfer_chunk_mb: float = setting(
        64.0, "State is sent in chunks of at most this many MiB (bounds the extra memory of a transfer).", min=0.001
    )
    snapshot_buffers: bool = setting(
        True,
        "Keep a copy of the model's buffers (e.g. BatchNorm statistics) at each committed step, so a step "
        "abandoned after its forward pass can be undone. Costs one buffer copy per step; free without buffers.",
    )
    peer_copies: int = setting(
        1,
        "Pure FSDP (a 1 x S mesh, no replica; HSDP too with peer_copies_in_hsdp): how many ring neighbours keep a copy"
        " of each rank's shard (parameters, optimizer state and everything else that moves) in host memory, so that a "
        "sudden crash is rebuilt from a neighbour instead of stopping the job: 1 survives any crash that spares the "
        "next slot, 2 any two adjacent ones. 0 = off. Costs host memory (per rank: 3 own copies, 2 with "
        "peer_copy_sync, + 2 x this many neighbour copies of a shard) and a stream of one shard per neighbour every "
        "peer_copy_every_steps steps.",
        min=0,
    )
    peer_copies_in_hsdp: bool = setting(
        False,
        "HSDP (an R x S mesh, R > 1): keep peer copies too (peer_copies neighbours in each replica's row), a second "
        "line of defence for when every replica's holder of a shard dies at once; while one is left the copies are "
        "not used. Off by default: the replicas already cover any loss that leaves one holder per shard, and an "
        "HSDP shard is R times larger than a pure FSDP one over the same ranks, so the copies' host memory "
        "(per rank: (3 + 2 x peer_copies) shards) is R times dearer too.",
    )
    peer_copy_every_steps: int = setting(
        1,
        "Refresh the peer copies after every K-th committed step (K = 1: after every step). A crash then rolls "
        "the job back in memory to the last complete copy, at most about K steps; the job's report says how many "
        "steps were computed again.",
        min=1,
    )
    peer_copy_sync: bool = setting(
        False,
        "With peer copies and peer_copy_every_steps = 1: a step commits only once every rank's copy of it has been "
        "acknowledged by its neighbours (a one-integer vote of all ranks after the copies), so a crash at any moment "
        "recomputes no committed step: it costs the step in progress, as it would without copies. The copy then runs "
        "on the step's critical path (and a rank keeps 2 copies of its own shard instead of 3). Off: it overlaps the "
        "next step's forward and backward pass, and a crash in that window (from a step's update until its copy is "
        "acknowledged) recomputes that one step.",
    )
    failure_domains: str = setting(
        "auto",
        "Failure domains bigger than a node (racks, leaf switches, Slurm blocks), which order the peer-copy ring (a "
        "shard's copies in other domains) and place spares (outside the domains that lost a node): 'auto' from "
        "Slurm's topology (the task's SLURM_TOPOLOGY_ADDR, else topology.conf beside slurm.conf), 'nodes' (each node "
        "its own domain), 'off' (the ring in slot order, spares by readiness alone), or the path of a site map "
        "file, one 'HOSTLIST DOMAIN' per line (docs/user-guide.md, 'Failure domains').",
    )
    replica_check_every_steps: int = setting(
        200,
        "The runtime net for silent divergence: after every K-th committed step (step + 1 divisible by K), the "
        "replicas of each state (every DDP rank; the HSDP ranks holding the same shard) compare checksums of their "
        "parameters and optimizer state (DDP: and buffers), one all_gather of three integers per rank; a mismatch "
        "stops the job, naming the step, the slots and the first differing tensor. While on, every state transfer "
        "(recovery, migration, peer copy) is checked too: the receiver's loaded state against its sender's "
        "checksums. 0 = off (both). Pure FSDP has no replicas: only its transfers are checked. Costs one read of "
        "the state per check (docs/user-guide.md, 'The runtime net').",
        min=0,
    )
    snapshot_dir: str = setting(
        "clockwork-snapshots/{job}",
        "Where snapshots go ({job}: the Slurm job id, or 'local'); relative to the launcher's working directory. "
        "Must be shared by every node for a multi-node job. Environment: CLOCKWORK_SNAPSHOT_DIR.",
    )
    snapshot_interval_s: float = setting(
        0.0,
        "Take a snapshot every this many seconds (0: off). The coordinator picks a step a little ahead of the "
        "fastest rank so that every rank snapshots the same step. Environment: CLOCKWORK_SNAPSHOT (20m, 1h, off; "
        "set by sbatch --clockwork-snapshot).",
        min=0.0,
    )
    snapshot_every_steps: int = setting(
        0, "Also take a snapshot after every N-th step (step + 1 divisible by N; 0: off). Needs no coordination.", min=0
    )
    snapshot_keep: int = setting(3, "Complete snapshots kept; older ones are removed once a new one exists.", min=1)
    snapshot_quota: str = setting(
        "",
        "Most bytes this job's snapshots may hold at once on disk (snapshot_keep snapshots and the one being "
        "written), checked at start: bytes or 500G, 2T (binary units); empty: none. The site's [snapshots] quota "
        "in clockwork.toml is a ceiling this cannot raise.",
    )
    snapshot_arena_max: str = setting(
        "32G",
        "Most bytes of /dev/shm each rank stages a snapshot in (bytes or 512M, 4G; binary units, whole 4 KiB pages). "
        "A larger share goes to the writer through this arena a window at a time, and the optimizer step after "
        "a snapshot waits until all but the last window are written; empty or 0: an arena the size of the "
        "rank's share, kept for the job (docs/user-guide.md, 'Host memory and storage').",
    )
    snapshot_timeout_s: float = setting(
        600.0,
        "How long rank 0's writer waits for every rank's shard before it declares the snapshot failed (and how "
        "long a finishing rank waits for its snapshot in flight).",
        min=0.1,
    )
    budget_policy: str = setting(
        "refuse",
        "At start every rank sizes the job's snapshot staging (/dev/shm), peer copies (host memory) and snapshot "
        "retention (the snapshot filesystem, the snapshot quota) against what its node and the filesystem have "
        "(docs/user-guide.md, 'Host memory and storage'). What does not fit: 'refuse' stops the job before its "
        "first step with the numbers and the setting to change; 'degrade' trains without that feature (snapshots, "
        "or peer copies), with a warning.",
        choices=("refuse", "degrade"),
    )
    restore: str = setting(
        "auto",
        "'auto': restore the newest good snapshot when Slurm requeued the job (SLURM_RESTART_COUNT > 0); "
        "'latest': restore it now (an error if there is none); 'never'; or the path of a snapshot directory or "
        "of one snapshot (torchpass run --restore).",
    )
    transparent_strict: bool = setting(
        False,
        "Model-transparent mode: treat every start-up warning about the script (a loader it cannot track, "
        "several optimizers, gradient accumulation, ...) as an error that stops the job.",
    )
    spare_warmup: bool = setting(
        True,
        "Model-transparent mode: a spare imports the modules its script imports (read from the source, not run) "
        "before it reports ready, and a local job's zygote preloads the frameworks the script imports "
        "(lightning, transformers, accelerate); off = a replacement imports them after the failure, on the "
        "recovery's critical path.",
    )
    log_level: str = setting(
        "info",
        "Level of TorchPass's own log on the ranks when the script configured no logging itself.",
        choices=("debug", "info", "warning", "error"),
    )

    def __post_init__(self) -> None:
        """Every value checked by the one rule the daemon's settings follow too (type, choices, minimum)."""
        for f in fields(self):
            try:
                object.__setattr__(self, f.name, coerce(f, getattr(self, f.name), text_ok=False))
            except FieldValueError as exc:
                raise ConfigError(f"torchpass config: {f.name}: {exc}") from None
        try:
            parse_size(self.snapshot_quota, "snapshot_quota")
            arena_max = parse_size(self.snapshot_arena_max, "snapshot_arena_max")
        except ConfigError as exc:
            raise ConfigError(f"torchpass config: {exc}") from None
        if 0 < arena_max < 4096:
            raise ConfigError(
                f"torchpass config: snapshot_arena_max: at least one 4 KiB page (or 0: the whole share), "
                f"got {self.snapshot_arena_max!r}"
            )
        if self.peer_copies > 2:
            raise ConfigError(f"torchpass config: peer_copies: 0, 1 or 2 neighbours, got {self.peer_copies}")
        if self.peer_copy_sync and self.peer_copy_every_steps != 1:
            raise ConfigError(
                "torchpass config: peer_copy_sync needs peer_copy_every_steps = 1 (a step is undone from the copy of "
                f"the step before it), got peer_copy_every_steps = {self.peer_copy_every_steps}"
            )

    # ----- construction ---------------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every valid key, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Key -> documentation, for ``--help`` and generated docs."""
        return {f.name: f.metadata["doc"] for f in fields(cls)}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: TorchPassConfig | None = None) -> TorchPassConfig:
        """``base`` (default: the defaults) with ``values`` applied; any unknown key is a :class:`ConfigError`."""
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise ConfigError(
                f"torchpass config: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(cls.keys())}"
            )
        return replace(base or cls(), **dict(values))

    def with_overrides(self, **values: Any) -> TorchPassConfig:
        """A copy with ``values`` applied (unknown keys are errors)."""
        return type(self).from_mapping(values, base=self)

    @classmethod
    def from_file(cls, path: str | Path, base: TorchPassConfig | None = None) -> TorchPassConfig:
        """Read a TOML (top-level keys or a ``[torchpass]`` table) or JSON file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"torchpass config: cannot read {path}: {exc.strerror}") from None
        try:
            data: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"torchpass config: {path} is not valid {path.suffix or 'TOML'}: {exc}") from None
        if isinstance(data, dict) and isinstance(data.get("torchpass"), dict) and len(data) == 1:
            data = data["torchpass"]
        if not isinstance(data, dict):
            raise ConfigError(f"torchpass config: {path} must hold a table of settings")
        return cls.from_mapping(data, base=base)

    def with_assignment(self, assignment: str) -> TorchPassConfig:
        """Apply one ``KEY=VALUE`` (the CLI's ``--set``); the value is parsed by the field's type."""
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"torchpass config: --set wants KEY=VALUE, got {assignment!r}")
        defaults = {f.name: f for f in fields(self)}
        if key not in defaults:
            raise ConfigError(f"torchpass config: unknown key {key!r}; valid keys: {', '.join(self.keys())}")
        try:
            value = coerce(defaults[key], raw, text_ok=True)
        except FieldValueError as exc:
            raise ConfigError(f"torchpass config: {key}: {exc}") from None
        return self.with_overrides(**{key: value})

    # ----- transport to the ranks -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field."""
        return asdict(self)

    def to_json(self) -> str:
        """Compact JSON, as passed in ``TORCHPASS_CONFIG``."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TorchPassConfig:
        """The launcher's configuration from ``TORCHPASS_CONFIG`` (defaults when unset)."""
        env = os.environ if environ is None else environ
        raw = env.get(ENV_CONFIG, "")
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"torchpass config: {ENV_CONFIG} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"torchpass config: {ENV_CONFIG} must hold a JSON object")
        return cls.from_mapping(data)


# Every field must have a default (the dataclass is constructed with no arguments all over the code).
assert all(f.default is not MISSING for f in fields(TorchPassConfig))
