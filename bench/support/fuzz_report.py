"""The fuzzer's summary: a coverage table (how many cases had each feature value, and their verdicts) and one JSON
line (cases, verdict counts, feature coverage, failing seeds).

Why coverage by feature value: a run of many cases that all drew the same few values proves little; the table
shows at a glance which values were exercised, how often, and where the failures and refusals cluster.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from .fuzz_case import CaseResult

VERDICTS = ("bitwise", "refused", "stopped", "FAIL")
HIDDEN = ("faults", "seed")  # per-case values, not coverage


def coverage(results: Sequence[CaseResult]) -> dict[str, dict[str, Counter[str]]]:
    """feature -> value -> verdict counts."""
    table: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for result in results:
        for name, value in result.case.features().items():
            if name not in HIDDEN:
                table[name][str(value)][result.verdict.verdict] += 1
    return table


def coverage_table(results: Sequence[CaseResult]) -> str:
    """The coverage as aligned text: one row per feature value."""
    rows: list[tuple[str, ...]] = [("feature", "value", "cases", *VERDICTS)]
    for name, values in coverage(results).items():
        for value in sorted(values):
            counts = values[value]
            rows.append((name, value, str(sum(counts.values())), *(str(counts[v]) for v in VERDICTS)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def summary(results: Sequence[CaseResult], seconds: float) -> dict[str, Any]:
    """The JSON line's content."""
    verdicts = Counter(result.verdict.verdict for result in results)
    failing = [result for result in results if result.verdict.failed]
    return {
        "cases": len(results),
        "seconds": round(seconds, 1),
        "verdicts": {v: verdicts[v] for v in VERDICTS},
        "coverage": {
            name: {value: sum(counts.values()) for value, counts in values.items()}
            for name, values in coverage(results).items()
        },
        "failing_seeds": [result.case.seed for result in failing],
        "failures": [{"seed": r.case.seed, "kind": r.verdict.kind, "detail": r.verdict.detail[:500]} for r in failing],
        "refusals": [
            {"seed": r.case.seed, "reason": r.verdict.detail[:300]} for r in results if r.verdict.verdict == "refused"
        ],
    }


def json_line(results: Sequence[CaseResult], seconds: float) -> str:
    return json.dumps(summary(results, seconds), sort_keys=True)
