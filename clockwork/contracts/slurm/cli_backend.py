"""Slurm through its client commands (squeue, sinfo, sacct, scontrol, sbatch, scancel, sacctmgr).

Every command runs with an explicit ``SLURM_CONF`` (without it, clients look the controller up by DNS
SRV and fail or hang), ``SLURM_TIME_FORMAT=standard`` (ISO times), none of the user's ``SQUEUE_*``/
``SINFO_*``/``SACCT_*`` format variables, in its own session, and under a timeout: clients block 10 s
and more when slurmctld is down, and a hung client must not hang the daemon.

Output formats, per command, chosen from what each Slurm release really prints:

- jobs: ``squeue --json=VERSION --states=all --jobs=N`` (22.05 ignores both filters with ``--json`` and dumps
  every job, so the record is picked here; 24.11 applies them, and without ``--states=all`` leaves out a
  job that has ended, which slurmctld still knows for MinJobAge), else ``scontrol -o show job N``;
- nodes: ``sinfo --json`` before 23.02, ``scontrol --json show node`` from 23.02 (newer sinfo
  aggregates nodes), else ``scontrol -o show node``;
- accounting: ``sacct --parsable2`` always. The JSON of 22.05 (dbv0.0.38) and 23.02 reports every
  normal exit as ``{"status": "SUCCESS", "return_code": 0}`` (WIFEXITED is tested before the exit
  status), so a job that exited 3 would read 0:0; the text ExitCode column is exact.

``--json=VERSION`` names one data_parser version, chosen by release
(:mod:`clockwork.contracts.slurm.data_parser`: ``v0.0.42`` from 24.11 through 26.05, plain ``--json`` before
24.11). Whether a command accepts ``--json`` is learned on first use and remembered per instance: an
"unrecognized option" or a missing serializer plugin switches that command to text for good.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clockwork.contracts.errors import SlurmError
from clockwork.contracts.hostlist import expand_hostlist
from clockwork.contracts.slurm.backend import AcctRecord, JobInfo, NodeInfo, SlurmVersion, node_state
from clockwork.contracts.slurm.data_parser import json_option
from clockwork.contracts.slurm.resources import JobResources, parse_resources_json, parse_resources_scontrol

__all__ = [
    "CliBackend",
    "SlurmTimeoutError",
    "format_wait_status",
    "json_errors",
    "parse_nodes_json",
    "parse_sacct_parsable",
    "parse_scontrol_jobs",
    "parse_scontrol_nodes",
    "parse_scontrol_record",
    "parse_squeue_json",
    "parse_version",
]

_log = logging.getLogger("clockwork.slurm")

ESLURM_INVALID_JOB_ID = 2017
SACCT_FIELDS = ("JobID", "State", "NodeList", "Start", "End", "ExitCode", "AdminComment")
"""AdminComment comes last so that a ``|`` inside it cannot shift the other columns."""

_DROPPED_ENV_PREFIXES = ("SQUEUE_", "SINFO_", "SACCT_", "SCONTROL_")
_DROPPED_ENV = frozenset({"SLURM_CLUSTERS", "SLURM_CONF", "SLURM_TIME_FORMAT"})
_JSON_UNSUPPORTED = re.compile(
    r"unrecognized option|invalid option|unknown option|openapi plugin|serializer|mime type"
    r"|unable to find plugin|output not supported",
    re.I,
)
_INVALID_JOB = re.compile(r"invalid job id", re.I)
_ALREADY_DONE = re.compile(r"already completing or completed|invalid job id", re.I)
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")
_SCONTROL_KEY = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/.\-]*)=")
_REASON_STAMP = re.compile(r"\s*\[[^\]\s]*@[^\]]*\]$")
_USER_ID = re.compile(r"\(\d+\)$")
_SBATCH_ID = re.compile(r"(\d+)(?:;\S*)?")
_COMMENT_FORBIDDEN = re.compile(r"[\"'\n\r]")
_FLAG_JOB_STATES = (
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
)
_NO_VAL = 0xFFFFFFFE


class SlurmTimeoutError(SlurmError):
    """A Slurm command did not finish in time (typically: slurmctld or slurmdbd down or overloaded)."""


class CliBackend:
    """:class:`~clockwork.contracts.slurm.backend.SlurmBackend` on top of Slurm's client commands.

    ``bin_dir`` selects the directory holding the client commands (default: ``PATH``);
    ``timeout_s`` bounds every command.
    """

    def __init__(self, slurm_conf: Path, bin_dir: Path | None = None, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.slurm_conf = Path(slurm_conf).expanduser()
        self.bin_dir = Path(bin_dir).expanduser() if bin_dir is not None else None
        self.timeout_s = float(timeout_s)
        self._json_ok: dict[str, bool] = {}
        self._version: SlurmVersion | None = None

    def __repr__(self) -> str:
        return f"CliBackend(slurm_conf={str(self.slurm_conf)!r}, bin_dir={self.bin_dir!r})"

    # ------------------------------------------------------------------ protocol

    def version(self) -> SlurmVersion:
        if self._version is None:
            self._version = parse_version(self._run(["sinfo", "--version"]).stdout)
        return self._version

    def ping(self) -> bool:
        try:
            proc = self._run(["scontrol", "ping"], check=False)
        except SlurmTimeoutError:
            return False
        text = proc.stdout + proc.stderr
        if re.search(r"\bis UP\b", text):
            return True
        if re.search(r"\bis DOWN\b", text):
            return False
        raise self._failure(["scontrol", "ping"], proc)

    def nodes(self) -> list[NodeInfo]:
        if self.version() >= (23, 2):
            key, argv = "scontrol", ["scontrol", self._json(), "show", "node"]
        else:
            key, argv = "sinfo", ["sinfo", self._json()]
        doc = self._json_query(key, argv)
        if doc is not None:
            errors = json_errors(doc)
            if errors:
                raise SlurmError(f"`{shlex.join(argv)}` reported: {'; '.join(m for _, m in errors)}")
            return parse_nodes_json(doc)
        return parse_scontrol_nodes(self._run(["scontrol", "-o", "show", "node"]).stdout)

    def job(self, job_id: int) -> JobInfo | None:
        argv = ["squeue", self._json(), "--states=all", f"--jobs={job_id}"]
        try:
            doc = self._json_query("squeue", argv)
        except SlurmError as exc:
            if _INVALID_JOB.search(str(exc)):
                return None
            raise
        if doc is not None:
            errors = json_errors(doc)
            if any(code == ESLURM_INVALID_JOB_ID or _INVALID_JOB.search(msg) for code, msg in errors):
                return None
            if errors:
                raise SlurmError(f"`{shlex.join(argv)}` reported: {'; '.join(m for _, m in errors)}")
            return next((j for j in parse_squeue_json(doc) if j.job_id == job_id), None)
        try:
            out = self._run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        except SlurmError as exc:
            if _INVALID_JOB.search(str(exc)):
                return None
            raise
        jobs = parse_scontrol_jobs(out)
        return next((j for j in jobs if j.job_id == job_id), jobs[0] if jobs else None)

    def job_resources(self, job_id: int) -> JobResources | None:
        """The job's GRES per node, account, QOS and time limit (what a stand-in allocation asks for again);
        None when slurmctld does not know the job. Not part of :class:`SlurmBackend`: only the borrowing
        daemon, which always holds this backend, needs it."""
        argv = ["squeue", "--json", "--states=all", f"--jobs={job_id}"]
        doc = self._json_query("squeue", argv)
        if doc is not None:
            return parse_resources_json(doc, job_id)
        proc = self._run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if proc.returncode != 0:
            if _INVALID_JOB.search(proc.stderr):
                return None
            raise self._failure(["scontrol", "show", "job", str(job_id)], proc)
        for line in proc.stdout.splitlines():
            fields = parse_scontrol_record(line)
            if _as_int(fields.get("JobId")) == job_id:
                start = fields.get("StartTime", "")
                try:
                    epoch = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S")) if start[:1].isdigit() else 0.0
                except ValueError:
                    epoch = 0.0
                return parse_resources_scontrol(fields, job_id, epoch)
        return None

    def submit(self, script: Path | str, args: Sequence[str] = ()) -> int:
        if isinstance(args, str):
            raise TypeError("args must be a sequence of sbatch options, not one string")
        argv = ["sbatch", "--parsable", *args]
        argv.append(str(script) if isinstance(script, Path) else f"--wrap={script}")
        out = self._run(argv).stdout
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        match = _SBATCH_ID.fullmatch(lines[-1]) if lines else None
        if match is None:
            raise SlurmError(f"`{shlex.join(argv)}` printed no job id: {out.strip()!r}")
        return int(match.group(1))

    def queue_json(self) -> dict[str, Any]:
        """Every job slurmctld knows, as ``squeue --json`` prints it (the borrowing policy reads fields that
        :class:`JobInfo` leaves out: account, QOS, start time, requeue)."""
        argv = ["squeue", self._json()]
        doc = self._json_query("squeue", argv)
        if doc is None:
            raise SlurmError("`squeue --json` is not usable with this Slurm: borrowing needs it")
        errors = json_errors(doc)
        if errors:
            raise SlurmError(f"`{shlex.join(argv)}` reported: {'; '.join(m for _, m in errors)}")
        return doc

    def run_text(self, argv: Sequence[str]) -> str:
        """Standard output of one client command (SlurmError when it fails or times out)."""
        return self._run(argv).stdout

    def cancel(self, job_id: int) -> None:
        argv = ["scancel", str(job_id)]
        proc = self._run(argv, check=False)
        if proc.returncode == 0:
            return
        if _ALREADY_DONE.search(proc.stderr + proc.stdout):
            _log.debug("scancel %s: job already gone (%s)", job_id, proc.stderr.strip())
            return
        raise self._failure(argv, proc)

    def accounting(self, job_id: int, all_steps: bool = False) -> list[AcctRecord]:
        argv = [
            "sacct",
            f"--jobs={job_id}",
            "--noheader",
            "--parsable2",
            f"--format={','.join(SACCT_FIELDS)}",
        ]
        if not all_steps:
            argv.append("--allocations")
        return parse_sacct_parsable(self._run(argv).stdout)

    def set_admin_comment(self, job_id: int, text: str) -> None:
        _check_comment(text)
        live = self.job(job_id)
        if live is not None and not live.finished:
            argv = ["scontrol", "update", f"JobId={job_id}", f"AdminComment={text}"]
            proc = self._run(argv, check=False)
            if proc.returncode == 0:
                if live.restart_count > 0:
                    # slurmctld sends a live job's AdminComment to slurmdbd only when the job ends, and a requeued
                    # job's earlier runs are slurmdbd records only: write the newest of those too (best effort;
                    # measured on 22.05: without this, `sacct -D` shows the preempted run with no comment).
                    db = ["sacctmgr", "-i", "modify", "job", "where", f"JobID={job_id}", "set", f"AdminComment={text}"]
                    done = self._run(db, check=False)
                    if done.returncode != 0:
                        _log.info("job %s: AdminComment not written to slurmdbd: %s", job_id, done.stderr.strip())
                return
            if not re.search(r"already finished|completed|invalid job id", proc.stderr, re.I):
                raise self._failure(argv, proc)
            _log.debug("job %s ended while setting AdminComment; writing it to slurmdbd", job_id)
        argv = ["sacctmgr", "-i", "modify", "job", "where", f"JobID={job_id}", "set", f"AdminComment={text}"]
        proc = self._run(argv)
        if "nothing modified" in proc.stdout.lower():
            raise SlurmError(f"`{shlex.join(argv)}`: slurmdbd has no record of job {job_id}")

    def drain(self, node: str, reason: str) -> None:
        if not reason.strip():
            raise ValueError("Slurm requires a reason to drain a node")
        self._run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str) -> None:
        self._run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

    def expand_hostlist(self, expr: str) -> list[str]:
        """Pure Python first; ``scontrol show hostnames`` only for syntax the local parser rejects."""
        try:
            return expand_hostlist(expr)
        except ValueError as local_error:
            argv = ["scontrol", "show", "hostnames", expr]
            proc = self._run(argv)
            # scontrol 22.05 exits 0 and prints "Invalid hostlist: ..." on bad input.
            if "invalid hostlist" in (proc.stdout + proc.stderr).lower():
                raise SlurmError(f"invalid hostlist {expr!r}: {local_error}") from None
            return proc.stdout.split()

    # ------------------------------------------------------------------ plumbing

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV_PREFIXES) and k not in _DROPPED_ENV}
        env["SLURM_CONF"] = str(self.slurm_conf)
        env["SLURM_TIME_FORMAT"] = "standard"
        return env

    def _exe(self, tool: str) -> str:
        return str(self.bin_dir / tool) if self.bin_dir is not None else tool

    def _run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one client command; raise SlurmError when it cannot start, times out or (check) fails."""
        cmd = [self._exe(argv[0]), *argv[1:]]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self._env(),
                start_new_session=True,
            )
        except OSError as exc:
            where = f"in {self.bin_dir}" if self.bin_dir is not None else "on PATH"
            raise SlurmError(f"cannot run `{argv[0]}` ({where}): {exc.strerror or exc}") from exc
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            # The command runs in its own session: kill its whole process group, then reap it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            raise SlurmTimeoutError(
                f"`{shlex.join(argv)}` did not finish within {self.timeout_s:g} s "
                f"(is slurmctld up? SLURM_CONF={self.slurm_conf})"
            ) from None
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        _log.debug("%s -> exit %s in %.3f s", shlex.join(argv), proc.returncode, time.monotonic() - started)
        if check and proc.returncode != 0:
            raise self._failure(argv, result)
        return result

    @staticmethod
    def _failure(argv: Sequence[str], proc: subprocess.CompletedProcess[str]) -> SlurmError:
        detail = proc.stderr.strip() or proc.stdout.strip() or "no output"
        return SlurmError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): {detail}")

    def _json(self) -> str:
        """The JSON option this release's clients get: one data_parser version for every tested release."""
        return json_option(self.version())

    def _json_query(self, key: str, argv: Sequence[str]) -> dict[str, Any] | None:
        """Run a ``--json`` command; None if this Slurm cannot answer it in JSON (remembered per key)."""
        if self._json_ok.get(key) is False:
            return None
        proc = self._run(argv, check=False)
        if proc.returncode != 0:
            if _JSON_UNSUPPORTED.search(proc.stderr + proc.stdout):
                self._no_json(key, proc.stderr.strip() or proc.stdout.strip())
                return None
            raise self._failure(argv, proc)
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            if key not in self._json_ok:
                self._no_json(key, "output is not a JSON object")
                return None
            raise SlurmError(f"`{shlex.join(argv)}` printed no JSON object: {proc.stdout[:200]!r}")
        self._json_ok[key] = True
        return doc

    def _no_json(self, key: str, why: str) -> None:
        self._json_ok[key] = False
        first = why.splitlines()[0] if why else "?"
        _log.info("`%s --json` is not usable with this Slurm (%s); using text output", key, first)


# ---------------------------------------------------------------------- parsers (pure functions)


def parse_version(text: str) -> SlurmVersion:
    """``"slurm-wlm 22.05.8"`` / ``"slurm 23.11.1"`` -> ``(22, 5, 8)`` / ``(23, 11, 1)``."""
    match = _VERSION.search(text)
    if match is None:
        raise SlurmError(f"cannot read a Slurm version from {text.strip()!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def json_errors(doc: Mapping[str, Any]) -> list[tuple[int | None, str]]:
    """The ``errors`` list of a Slurm JSON answer as (error number, message) pairs.

    22.05 exits 0 even when slurmctld is unreachable and only fills ``errors``; its squeue writes
    ``error_number``/``description``, its sinfo ``errno``/``error``.
    """
    out: list[tuple[int | None, str]] = []
    for err in doc.get("errors") or []:
        if isinstance(err, Mapping):
            code = _as_int(err.get("error_number", err.get("errno", err.get("error_code"))))
            parts = [str(err[k]) for k in ("description", "error", "source") if err.get(k)]
            out.append((code, ": ".join(parts) or json.dumps(err)))
        else:
            out.append((None, str(err)))
    return out


def parse_squeue_json(doc: Mapping[str, Any]) -> list[JobInfo]:
    """Jobs from ``squeue --json`` (22.05 openapi v0.0.38 and the 23.02+ data_parser layouts)."""
    jobs = doc.get("jobs")
    if not isinstance(jobs, list):
        raise SlurmError("squeue JSON has no 'jobs' list")
    out: list[JobInfo] = []
    for job in jobs:
        job_id = _as_int(job.get("job_id"))
        if job_id is None:
            continue
        out.append(
            JobInfo(
                job_id=job_id,
                name=_as_str(job.get("name")),
                state=_job_state(job.get("job_state")),
                user=_as_str(job.get("user_name")),
                partition=_as_str(job.get("partition")),
                nodes=expand_hostlist(_as_str(job.get("nodes"))),
                exit_code=_exit_code(job.get("exit_code")),
                restart_count=_as_int(job.get("restart_cnt")) or 0,
                admin_comment=_as_str(job.get("admin_comment")),
            )
        )
    return out


def parse_nodes_json(doc: Mapping[str, Any]) -> list[NodeInfo]:
    """Nodes from 22.05 ``sinfo --json`` or 23.02+ ``scontrol --json show node``."""
    nodes = doc.get("nodes")
    if not isinstance(nodes, list):
        raise SlurmError("Slurm JSON has no 'nodes' list")
    out: list[NodeInfo] = []
    for node in nodes:
        name = _as_str(node.get("name"))
        if not name:
            continue
        out.append(
            NodeInfo(
                name=name,
                state=node_state(node.get("state"), node.get("state_flags") or ()),
                addr=_as_str(node.get("address")),
                partitions=[str(p) for p in node.get("partitions") or []],
                reason=_as_str(node.get("reason")),
            )
        )
    return out


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One ``scontrol -o show ...`` line as a dict. ``(null)`` becomes "".

    A value runs up to the next `` Key=``, so values with spaces survive (``Reason=link flap``); a
    value that itself contains `` word=`` would be split there, which is why JSON is preferred.
    """
    matches = list(_SCONTROL_KEY.finditer(line))
    fields: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        value = line[match.end() : end].strip()
        fields.setdefault(match.group(1), "" if value == "(null)" else value)
    return fields


def parse_scontrol_jobs(text: str) -> list[JobInfo]:
    """Jobs from ``scontrol -o show job`` (one line per job)."""
    out: list[JobInfo] = []
    for line in text.splitlines():
        fields = parse_scontrol_record(line)
        job_id = _as_int(fields.get("JobId"))
        if job_id is None:
            continue
        out.append(
            JobInfo(
                job_id=job_id,
                name=fields.get("JobName", ""),
                state=fields.get("JobState", ""),
                user=_USER_ID.sub("", fields.get("UserId", "")),
                partition=fields.get("Partition", ""),
                nodes=expand_hostlist(fields.get("NodeList", "")),
                exit_code=fields.get("ExitCode", "") or "0:0",
                restart_count=_as_int(fields.get("Restarts")) or 0,
                admin_comment=fields.get("AdminComment", ""),
            )
        )
    return out


def parse_scontrol_nodes(text: str) -> list[NodeInfo]:
    """Nodes from ``scontrol -o show node`` (one line per node)."""
    out: list[NodeInfo] = []
    for line in text.splitlines():
        fields = parse_scontrol_record(line)
        name = fields.get("NodeName", "")
        if not name:
            continue
        partitions = fields.get("Partitions", "")
        out.append(
            NodeInfo(
                name=name,
                state=node_state(fields.get("State", "")),
                addr=fields.get("NodeAddr", ""),
                partitions=[p for p in partitions.split(",") if p],
                reason=_REASON_STAMP.sub("", fields.get("Reason", "")),
            )
        )
    return out


def parse_sacct_parsable(text: str) -> list[AcctRecord]:
    """Rows of ``sacct --noheader --parsable2 --format=`` :data:`SACCT_FIELDS`."""
    out: list[AcctRecord] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = line.split("|", len(SACCT_FIELDS) - 1)
        if len(cols) != len(SACCT_FIELDS):
            raise SlurmError(f"unexpected sacct line (want {len(SACCT_FIELDS)} fields): {line!r}")
        job_id, state, nodelist, start, end, exit_code, comment = cols
        out.append(
            AcctRecord(
                job_id=job_id,
                state=state.split(" ", 1)[0],
                nodes=[] if nodelist in ("", "None assigned") else expand_hostlist(nodelist),
                start=_sacct_time(start),
                end=_sacct_time(end),
                exit_code=exit_code or "0:0",
                admin_comment=comment,
            )
        )
    return out


def format_wait_status(status: int) -> str:
    """A raw wait status (22.05 squeue ``exit_code``) as ``"exit:signal"``, the way scontrol prints it."""
    if status < 0 or status >= _NO_VAL:
        return "0:0"
    sig = status & 0x7F
    if sig and sig != 0x7F:
        return f"0:{sig}"
    return f"{(status >> 8) & 0xFF}:0"


# ---------------------------------------------------------------------- small helpers


def _check_comment(text: str) -> None:
    if _COMMENT_FORBIDDEN.search(text):
        raise ValueError("AdminComment must not contain quotes or newlines (sacctmgr rewrites quotes as backticks)")


def _as_int(value: Any) -> int | None:
    """Plain ints, numeric strings and 23.02+'s ``{"set": true, "number": N}`` wrappers."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def _as_str(value: Any) -> str:
    return "" if value is None else str(value)


def _job_state(value: Any) -> str:
    """22.05 gives a string; 23.02+ a list (base state first, then flags). Flags win, as in 22.05."""
    if isinstance(value, list):
        states = [str(s).upper() for s in value]
        return next((f for f in _FLAG_JOB_STATES if f in states), states[0] if states else "")
    return _as_str(value)


def _exit_code(value: Any) -> str:
    if value is None:
        return "0:0"
    if isinstance(value, Mapping):
        code = _as_int(value.get("return_code")) or 0
        sig_obj = value.get("signal")
        sig = 0
        if isinstance(sig_obj, Mapping):
            sig = _as_int(sig_obj.get("id", sig_obj.get("signal_id"))) or 0
        return f"{code}:{sig}"
    status = _as_int(value)
    return format_wait_status(status) if status is not None else "0:0"


def _sacct_time(value: str) -> str:
    return "" if value in ("", "Unknown", "None", "N/A") else value
