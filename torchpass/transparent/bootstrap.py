"""Model-transparent mode: TorchPass's guarantees for an unmodified DDP script (``torchpass run --transparent``).

``python -m torchpass.transparent.bootstrap SCRIPT ARGS...`` is what each rank and spare runs in this mode (the launcher
and the Slurm agents start it; ``--clockwork-ft=transparent`` selects it). It joins the job as
:func:`torchpass.init` does (a spare waits there for a slot), installs the interposers below, and runs the
script with :mod:`runpy` as ``__main__``, with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT`` set as ``torchrun`` would (rank = the TorchPass slot, which never changes).

What is interposed, and why:

* ``torch.distributed.init_process_group`` / ``destroy_process_group``: TorchPass owns the process group (it
  forms it at the first step boundary and rebuilds it after every membership change); the script's calls only
  check that its rank and world size agree. Until the group exists, ``is_initialized``, ``get_rank`` and
  ``get_world_size`` answer for it (a ``DistributedSampler`` built before the first step needs them).
* ``DistributedDataParallel(model, ...)`` builds TorchPass's DDP (:class:`torchpass.rank.ddp.TorchPassDDP`): its
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

Gradient accumulation: a step spans the batches up to its optimizer step, so an accumulation window is one
step, committed after its update and redone from its first batch when it fails.

Frameworks (:mod:`torchpass.frameworks`): the framework whose code calls ``init_process_group`` picks an
adapter (Lightning, the Hugging Face Trainer), which the session asks where the framework's loop differs from a
plain script's: its counters and callbacks are registered state, its replacement jumps to the replicas' epoch
instead of fast-forwarding, its set-up collectives run before any group exists. What an adapter cannot protect
is refused at start (a hand-written accelerate loop), and a script error before training fails the job at once
rather than every spare in turn.

What it cannot capture is documented in docs/user-guide.md ("Model-transparent mode"): arbitrary Python
state of the script (locals, lists of losses, counters), iterators it cannot see (a hand-written generator,
a loader without a DistributedSampler), loops bounded by their own step counters, collectives before the
first batch or after the training loop. The interposers warn while the script builds its objects, and
:meth:`Session.check_first_step` when the first step ends, when a script is outside what it protects
(``transparent_strict`` makes every warning an error).

Where it lives: this module is the bootstrap (join, install, run the script);
:mod:`torchpass.transparent.interposers` holds the replacements, :mod:`torchpass.transparent.session` the session
they feed (what the script built, the step boundary), and :mod:`torchpass.transparent.data` the data position
and the passes over the tracked loader.
"""

from __future__ import annotations

import os
import runpy
import sys

from torchpass.config import TorchPassConfig
from torchpass.errors import TorchPassError
from torchpass.frameworks.environment import torchrun_environment
from torchpass.launch.warmup import preimport
from torchpass.rank.start import init
from torchpass.rank_env import LaunchEnv
from torchpass.transparent.interposers import Interposers
from torchpass.transparent.session import Session, TransparentWarning

__all__ = ["Session", "TransparentWarning", "main"]


def main(argv: list[str] | None = None) -> int:
    """Join the job, install the interposers and run the script as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m torchpass.transparent.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    try:
        _run(args[0], args[1:])
    except TorchPassError as exc:  # its message says it all; a traceback per rank would bury it
        print(f"torchpass: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def _run(script: str, script_args: list[str]) -> None:
    launch = LaunchEnv.from_environ()
    warmed: tuple[list[str], float] | None = None
    if launch is not None and launch.role == "spare" and TorchPassConfig.from_env().spare_warmup:
        warmed = preimport(script)  # off the recovery's critical path (torchpass.launch.warmup)
    ctx = init()  # a spare waits here for a slot (and exits 0 if the job ends first)
    if warmed is not None and warmed[0]:
        ctx.log.info("spare warm-up imported %d modules of the script in %.2f s", len(warmed[0]), warmed[1])
    session = Session(ctx)
    Interposers(session).install()
    # What torchrun would set, so that scripts and frameworks written for it find their rank (the slot).
    torchrun_environment(os.environ, slot=ctx.slot, world_size=ctx.world_size, host=ctx.env.host, job_id=ctx.env.job_id)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        try:
            runpy.run_path(script, init_globals={"enumerate": session.enumerate}, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        session.finish()
    except TorchPassError as exc:
        # The script is outside what the mode protects: every rank finds it at the same point, and so would
        # every spare put in its place, so the job fails now instead of burning its spares one by one.
        ctx.link.report("fatal", message=str(exc))
        raise
    except Exception as exc:
        if ctx.generation < 0 and not ctx.is_replacement:
            # An original rank whose script fails before training ever started: a spare would run the same
            # script into the same error (a crash loop of spares), so the job fails now, with it.
            ctx.link.report(
                "fatal",
                message=f"slot {ctx.slot}: the script failed before training started: {type(exc).__name__}: "
                f"{str(exc)[:500]} (see the rank's traceback)",
            )
        raise


if __name__ == "__main__":
    sys.exit(main())
