"""The AdminComments that tie a borrow's two jobs together, so ``sacct -o AdminComment`` tells both sides.

* the preempted job: ``clockwork: preempted for job X (node N held by job H)`` (written while it is requeued);
* the training job: a ``clockwork-borrowed: N from job Y (holder H)`` segment, written at the borrow and kept
  by the Epilog when it replaces the comment with the job's summary (:func:`with_borrowed`).
"""

from __future__ import annotations

__all__ = ["BORROWED_TAG", "add_borrowed", "borrowed_part", "preempted_comment", "with_borrowed"]

BORROWED_TAG = "clockwork-borrowed:"
_SEPARATOR = "; "


def preempted_comment(job_id: int, node: str, holder: int) -> str:
    """What the preempted job's record says."""
    return f"clockwork: preempted for job {job_id} (node {node} held by job {holder})"


def borrowed_part(comment: str) -> str:
    """The ``clockwork-borrowed: ...`` segment of an AdminComment ('' when there is none)."""
    return next((s for s in comment.split(_SEPARATOR) if s.startswith(BORROWED_TAG)), "")


def add_borrowed(comment: str, node: str, from_job: int, holder: int) -> str:
    """``comment`` with one more borrowed node in its ``clockwork-borrowed:`` segment (made when missing)."""
    item = f"{node} from job {from_job} (holder {holder})"
    part = borrowed_part(comment)
    if not part:
        return _SEPARATOR.join(filter(None, (comment, f"{BORROWED_TAG} {item}")))
    return comment.replace(part, f"{part}, {item}", 1)


def with_borrowed(summary: str, previous: str) -> str:
    """The Epilog's summary, keeping what ``previous`` said about borrowed nodes (before ``report=``)."""
    part = borrowed_part(previous)
    if not part:
        return summary
    head, sep, report = summary.rpartition(f"{_SEPARATOR}report=")
    if sep:  # report=PATH stays last: readers take everything after it as the path
        return f"{head}{_SEPARATOR}{part}{sep}{report}"
    return f"{summary}{_SEPARATOR}{part}"
