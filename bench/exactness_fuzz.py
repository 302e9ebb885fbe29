#!/usr/bin/env python3
"""Exactness fuzzer: generated training scripts, fault-free and under SIGKILLs at random moments, compared bitwise.

Each case is drawn from one integer seed (``bench/support/fuzz_grammar.py``): a layout (DDP over 2 ranks, pure
FSDP2 over 2 or 4, HSDP 2 x 2), a mode (transparent: an unmodified torch script; model-aware: the TorchPass API),
gradient accumulation (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``), tied weights, one or two
optimizers with parameter groups, frozen parameters, a scheduler (per step, per epoch, ``ReduceLROnPlateau`` on an
all-reduced loss), clipping, mixed precision (FSDP2's ``MixedPrecisionPolicy``, CPU autocast in bf16, fp16 with a
``GradScaler``), BatchNorm, dropout, an EMA of the weights, a ``DistributedSampler`` with ``drop_last`` on or off
and an uneven last batch, and 1-3 faults (SIGKILLs at drawn moments, slot 0 among them, some inside the previous
recovery; a planned migration). The script is written into the case's folder (a standalone file), run once
without faults and once with them (``torchpass run --local``), and every slot's final state (model, every
optimizer, scheduler, scaler, EMA, BatchNorm buffers) is compared to the bit.

Verdicts: ``bitwise`` (every slot equal to the fault-free run), ``refused`` (the job failed at start with a
message), ``stopped`` (it stopped with a diagnosis, where the faults took every holder of some state); anything
else FAILS (a silent difference, a hang, a crash or crash loop, a stop the faults do not explain, a fault that was
not injected). One line per case, then a coverage table, then one JSON line. Exit status 1 if a case failed.

    .venv/bin/python bench/exactness_fuzz.py --quick            # under a minute: two small cases
    .venv/bin/python bench/exactness_fuzz.py --seed 1234        # replay one case
    .venv/bin/python bench/exactness_fuzz.py --cases 20 --out /tmp/fuzz
    .venv/bin/python bench/exactness_fuzz.py --minutes 60 --layouts hsdp2x2,fsdp1x4 --modes transparent
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from support.fuzz_case import CaseResult, run_case
from support.fuzz_grammar import LAYOUTS, MODES, draw_case
from support.fuzz_report import coverage_table, json_line

QUICK_SEEDS = (3900, 3513)  # two 2-rank DDP cases (aware; transparent with a migration), about 10 s each here


def _names(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    chosen = tuple(name for name in text.split(",") if name)
    unknown = [name for name in chosen if name not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"--{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seed", type=int, action="append", help="run the case of this seed (repeatable)")
    group.add_argument("--cases", type=int, help="run this many cases, seeds from --first-seed on")
    group.add_argument("--minutes", type=float, help="run cases for about this long (long mode)")
    group.add_argument("--quick", action="store_true", help="two small cases, under a minute")
    parser.add_argument("--first-seed", type=int, help="first seed of --cases/--minutes (default: drawn, printed)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, help="keep every case's folder here (default: failing cases only)")
    args = parser.parse_args(argv)
    layouts = _names(args.layouts, LAYOUTS, "layouts")
    modes = _names(args.modes, MODES, "modes")
    first = args.first_seed if args.first_seed is not None else random.SystemRandom().randrange(1 << 24)

    if args.seed:
        seeds: list[int] | None = list(args.seed)
    elif args.quick:
        seeds, layouts, modes = list(QUICK_SEEDS), LAYOUTS, MODES
    elif args.cases is not None:
        seeds = list(range(first, first + args.cases))
    else:
        seeds = None  # as many as fit in --minutes (default 10)
    budget_s = 60.0 * (args.minutes if args.minutes is not None else 10.0)
    if seeds is None or args.cases is not None:
        print(f"exactness_fuzz: seeds from {first} (--first-seed {first} replays this run)", flush=True)

    base = args.out or Path(tempfile.mkdtemp(prefix="exactness-fuzz-"))
    base.mkdir(parents=True, exist_ok=True)
    results: list[CaseResult] = []
    started = time.monotonic()
    seed = first
    while True:
        if seeds is not None:
            if len(results) == len(seeds):
                break
            seed = seeds[len(results)]
        else:
            elapsed = time.monotonic() - started
            average = elapsed / len(results) if results else 0.0
            if results and elapsed + average > budget_s:
                break
        case = draw_case(seed, layouts, modes)
        print(f"case seed={seed} features={case.describe()}", flush=True)
        folder = base / f"seed-{seed}"
        if folder.exists():
            raise SystemExit(f"{folder} exists already: give another --out")
        result = run_case(case, folder, keep=args.out is not None)
        results.append(result)
        print(result.line(), flush=True)
        seed += 1

    elapsed = time.monotonic() - started
    print()
    print(coverage_table(results))
    failing = [r for r in results if r.verdict.failed]
    print()
    for result in failing:
        print(f"FAILED seed={result.case.seed} ({result.verdict.kind}): {result.verdict.detail[:600]}")
        print(f"  its folder: {result.folder}")
    print(json_line(results, elapsed), flush=True)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
