"""Model-transparent mode: TorchPass's guarantees for an unmodified DDP script (``torchpass run --transparent``).

``python -m torchpass.transparent SCRIPT ARGS...`` is what each rank and spare runs in this mode (the launcher
and the Slurm agents start it; ``--clockwork-ft=transparent`` selects it). It joins the job as
:func:`torchpass.init` does (a spare waits there for a slot), installs the interposers below, and runs the
script with :mod:`runpy` as ``__main__``, with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT`` set as ``torchrun`` would (rank = the TorchPass slot, which never changes).

What is interposed, and why:

* ``torch.distributed.init_process_group`` / ``destroy_process_group``: TorchPass owns the process group (it
  forms it at the first step boundary and rebuilds it after every membership change); the script's calls only
  check that its rank and world size agree. Until the group exists, ``is_initialized``, ``get_rank`` and
  ``get_world_size`` answer for it (a ``DistributedSampler`` built before the first step needs them).
* ``DistributedDataParallel(model, ...)`` builds TorchPass's DDP (:class:`torchpass.ddp.TorchPassDDP`): its
  gradient averaging survives a dead peer by abandoning the step instead of raising into ``backward()``.
* ``torch.optim.Optimizer`` construction registers every optimizer (its state moves, its ``step`` skips an
  abandoned step); PyTorch's global optimizer step hooks count the optimizer steps of each step.
  LR schedulers and grad scalers are registered when they are built (their state moves and rolls back).
* The first ``DataLoader`` built over a ``DistributedSampler`` is *tracked*: iterating it is where the step
  boundaries are. Each ``next()`` on it closes the step in progress (commit, or roll back and recover),
  checks for a new generation, reseeds the RNGs from (seed, slot, step) and serves the batch at the data
  position. The data position (pass over the loader, batch index within the pass) is part of the state that
  moves, so a spare resumes at the same batch and a step abandoned by a failure is re-run with the same
  batch: the loader simply serves it again.
* The common collectives (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``, ...), when called inside
  a step, abandon the step instead of raising when a peer dies (as ``ctx.all_reduce`` does); called between
  steps (e.g. after an epoch), a failure makes the rank recover and run the collective again.

How a survivor unwinds: nothing is unwound by exception (an exception raised inside the script's loop body
would leave the loop, and a Python ``for`` loop cannot be resumed). As in model-aware mode, a failed
collective *abandons* the step: the rest of the body runs with the gradient hook, the optimizer, the grad
scaler and the interposed collectives doing nothing, and at the next ``next()`` on the tracked loader the
step is rolled back, the rank recovers, and the same batch is served again. The script's loop over the
loader does not advance, so its epochs still contain every batch exactly once.

How a newcomer jumps into the middle: it runs the script from the top. At its first ``next()`` on the tracked
loader it joins the generation and receives the state, data position included (pass P, batch I). It then
*fast-forwards*: iterations of passes before P end at once (``StopIteration``), with optimizer steps,
LR-scheduler steps and grad-scaler updates suppressed in between (the received state already contains
them), and pass P is served from batch I. The script's epoch counter lines up because it counts passes
over the loader exactly as the survivors' did.

What it cannot capture is documented in docs/user-guide.md ("Model-transparent mode"): arbitrary Python
state of the script (locals, lists of losses, counters), iterators it cannot see (a hand-written generator,
a loader without a DistributedSampler), loops bounded by their own step counters, gradient accumulation,
collectives before the first batch or after the training loop. The interposers warn while the script builds
its objects, and :meth:`Session.check_first_step` when the first step ends, when a script is outside what
it protects (``transparent_strict`` makes every warning an error).

Where it lives: this module is the bootstrap (join, install, run the script);
:mod:`torchpass.interposers` holds the replacements, and :mod:`torchpass.transparent_session` the session
they feed (what the script built, the data position, the step boundary).
"""

from __future__ import annotations

import os
import runpy
import sys

from torchpass.context import Context, init
from torchpass.errors import TorchPassError
from torchpass.interposers import Interposers
from torchpass.transparent_session import Session, TransparentWarning

__all__ = ["Session", "TransparentWarning", "main"]


def _torchrun_environment(ctx: Context) -> None:
    """What ``torchrun`` would set, so scripts written for it find their rank (init itself is TorchPass's)."""
    os.environ["RANK"] = str(ctx.slot)
    os.environ["WORLD_SIZE"] = str(ctx.world_size)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", ctx.env.host)
    os.environ.setdefault("MASTER_PORT", "29500")


def main(argv: list[str] | None = None) -> int:
    """Join the job, install the interposers and run the script as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m torchpass.transparent SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    try:
        _run(args[0], args[1:])
    except TorchPassError as exc:  # its message says it all; a traceback per rank would bury it
        print(f"torchpass: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def _run(script: str, script_args: list[str]) -> None:
    ctx = init()  # a spare waits here for a slot (and exits 0 if the job ends first)
    session = Session(ctx)
    Interposers(session).install()
    _torchrun_environment(ctx)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, init_globals={"enumerate": session.enumerate}, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    session.finish()


if __name__ == "__main__":
    sys.exit(main())
