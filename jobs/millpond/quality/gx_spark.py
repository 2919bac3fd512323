"""Fewer Spark jobs for a GX validation: a map expectation's unexpected examples are looked for only when
GX's own count says there are some.

Why: for every map expectation GX resolves, at the same level of its metric graph, the expectation's
``unexpected_values`` (a filter-limit-collect: one Spark job each, a full scan of the frame when nothing is
unexpected) and, a level later, its ``unexpected_count`` (bundled with the suite's other aggregates into one
``df.agg`` per domain). On a passing 1M-row batch those example jobs are most of validation's time and all
return ``[]``. Here the examples wait one level for their count, and a count of 0 answers them with ``[]``,
which is what GX's filter returns then (the count is GX's ``sum(when(condition, 1))`` over the same domain
the filter reads). GX still resolves every metric it needs and judges every expectation itself; a count that
is not zero, or that GX does not ask for next, gets the examples computed by GX as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_EXAMPLES = ".unexpected_values"
_COUNT = ".unexpected_count"


def _count_id(metric: Any) -> Any:
    """The id of the ``unexpected_count`` metric of the expectation whose examples ``metric`` are."""
    from great_expectations.validator.metric_configuration import MetricConfiguration

    value_kwargs = {k: v for k, v in (metric.metric_value_kwargs or {}).items() if k != "result_format"}
    return MetricConfiguration(metric.metric_name[: -len(_EXAMPLES)] + _COUNT, metric.metric_domain_kwargs,
                               value_kwargs).id


@contextlib.contextmanager
def examples_after_counts() -> Iterator[dict[str, int]]:
    """While open, GX's Spark engine resolves unexpected examples after their counts (see the module);
    yields a tally (``skipped``: examples answered by a zero count, ``computed``: examples GX computed).
    Not thread-safe, like GX: the caller holds the validation lock."""
    from great_expectations.execution_engine import SparkDFExecutionEngine

    original = SparkDFExecutionEngine.resolve_metrics
    waited: set[Any] = set()  # example ids already held back once: never twice
    tally = {"skipped": 0, "computed": 0}

    def resolve_metrics(self: Any, metrics_to_resolve: Any, metrics: Any = None,
                        runtime_configuration: Any = None) -> dict[Any, Any]:
        todo = list(metrics_to_resolve)
        examples = [m for m in todo if m.metric_name.endswith(_EXAMPLES)]
        rest = [m for m in todo if not m.metric_name.endswith(_EXAMPLES)]
        if not examples:
            return original(self, rest, metrics, runtime_configuration)
        resolved = dict(original(self, rest, metrics, runtime_configuration)) if rest else {}
        known = {**(metrics or {}), **resolved}
        compute = []
        for m in examples:
            count = known.get(_count_id(m))
            if count == 0:
                resolved[m.id] = []
                tally["skipped"] += 1
            elif count is None and m.id not in waited:
                waited.add(m.id)  # not answered now: GX asks again with the next level (its count, usually)
            else:
                compute.append(m)
        if compute:
            tally["computed"] += len(compute)
            resolved.update(original(self, compute, known, runtime_configuration))
        return resolved

    SparkDFExecutionEngine.resolve_metrics = resolve_metrics  # type: ignore[method-assign]
    try:
        yield tally
    finally:
        SparkDFExecutionEngine.resolve_metrics = original  # type: ignore[method-assign]
