"""What is computed: combiners (create / add / merge / extract, optional uncombine).

Accumulators must be JSON-serialisable: they live in the ``windows`` state table. Values keep
their type: a sum of integers stays an integer. A user combiner subclasses :class:`Combiner` and is
named in the pipeline config as ``aggregation: "my_module:MyCombiner"``.

Sums are checked: a window's sum must fit the pipeline's value type (a 64-bit integer, or a finite
float), so ``add_checked`` skips each element that would take the running sum out of range (the per-key
step drops it with a reason, see ``model.step``), and ``merge_checked`` says when merging windows would.
The running sum is taken in the batch's element order, so the rule gives the same result on every path.
"""

from __future__ import annotations

import importlib
import math
import operator
from functools import reduce
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Combiner:
    """Associative, commutative aggregation in the Dataflow/Beam CombineFn shape."""

    #: True if ``uncombine`` is implemented (retractions can be applied downstream cheaply).
    reversible: bool = False
    #: Arrow type name of extracted values: "int" follows the pipeline's value_type.
    output_type: str = "input"
    #: True if ``add_checked`` may skip values (the output has a range to keep)
    checked: bool = False
    #: True if the output is the sum of the values added (a negative value undoes a positive one): a stage
    #: reading an upstream's panes, retractions included, needs it (``model.stages``)
    additive: bool = False

    def create(self) -> Any:
        raise NotImplementedError

    def add(self, acc: Any, value: Any) -> Any:
        raise NotImplementedError

    def add_all(self, acc: Any, values: list[Any]) -> Any:
        """``add`` of each value in order (a batch hands a window its elements together); override
        only with the same result, order included (float sums round differently when regrouped)."""
        add = self.add
        for v in values:
            acc = add(acc, v)
        return acc

    def add_checked(self, acc: Any, values: list[Any]) -> tuple[Any, list[int]]:
        """``add_all`` of the values the output can hold: (accumulator, positions of the values skipped
        because adding them would put the output out of range). Unchecked combiners skip nothing."""
        return self.add_all(acc, values), []

    def merge(self, accs: list[Any]) -> Any:
        raise NotImplementedError

    def merge_checked(self, accs: list[Any]) -> Any | None:
        """``merge``, or None when the merged output would be out of range (windows then stay apart)."""
        return self.merge(accs)

    def extract(self, acc: Any) -> Any:
        raise NotImplementedError

    def uncombine(self, acc: Any, other: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no uncombine")


def fits(total: Any) -> bool:
    """Whether a sum can be stored: a 64-bit integer, or a finite float."""
    if isinstance(total, int):
        return INT64_MIN <= total <= INT64_MAX
    return math.isfinite(total)


class Sum(Combiner):
    reversible = True
    additive = True
    #: True: ``add_checked`` may skip values (the columnar path sends keys that might overflow to the
    #: element path, where skipped elements are reported; see ``runtime.layout.form_windows``)
    checked = True

    def create(self) -> Any:
        return 0

    def add(self, acc: Any, value: Any) -> Any:
        return acc + value

    def add_all(self, acc: Any, values: list[Any]) -> Any:
        return reduce(operator.add, values, acc)  # left to right, as ``add`` one by one

    def add_checked(self, acc: Any, values: list[Any]) -> tuple[Any, list[int]]:
        total = self.add_all(acc, values)
        if fits(total) and (not isinstance(total, int) or _bounded(acc, values)):
            return total, []  # no prefix can leave the range (a non-finite float prefix stays non-finite)
        skipped = []
        for i, v in enumerate(values):
            s = acc + v
            if fits(s):
                acc = s
            else:
                skipped.append(i)
        return acc, skipped

    def merge(self, accs: list[Any]) -> Any:
        return sum(accs, 0)

    def merge_checked(self, accs: list[Any]) -> Any | None:
        total = self.merge(accs)
        return total if fits(total) else None

    def extract(self, acc: Any) -> Any:
        return acc

    def uncombine(self, acc: Any, other: Any) -> Any:
        return acc - other


def _bounded(acc: int, values: list[int]) -> bool:
    """Whether no running sum of ``acc`` + values can leave the int64 range (three passes at C speed)."""
    if not values:
        return True
    biggest = max(max(values), -min(values))
    return abs(acc) + len(values) * biggest <= INT64_MAX


class Count(Sum):
    output_type = "int"
    checked = False
    additive = False

    def add_checked(self, acc: Any, values: list[Any]) -> tuple[Any, list[int]]:
        return acc + len(values), []

    def merge_checked(self, accs: list[Any]) -> Any | None:
        return self.merge(accs)

    def add(self, acc: Any, value: Any) -> Any:
        return acc + 1

    def add_all(self, acc: Any, values: list[Any]) -> Any:
        return acc + len(values)


class Min(Combiner):
    def create(self) -> Any:
        return None

    def add(self, acc: Any, value: Any) -> Any:
        return value if acc is None or value < acc else acc

    def merge(self, accs: list[Any]) -> Any:
        present = [a for a in accs if a is not None]
        return min(present) if present else None

    def extract(self, acc: Any) -> Any:
        return acc


class Max(Min):
    def add(self, acc: Any, value: Any) -> Any:
        return value if acc is None or value > acc else acc

    def merge(self, accs: list[Any]) -> Any:
        present = [a for a in accs if a is not None]
        return max(present) if present else None


class Mean(Combiner):
    reversible = True
    output_type = "float"

    def create(self) -> Any:
        return [0, 0]

    def add(self, acc: Any, value: Any) -> Any:
        return [acc[0] + value, acc[1] + 1]

    def merge(self, accs: list[Any]) -> Any:
        return [sum(a[0] for a in accs), sum(a[1] for a in accs)]

    def extract(self, acc: Any) -> Any:
        return acc[0] / acc[1] if acc[1] else None

    def uncombine(self, acc: Any, other: Any) -> Any:
        return [acc[0] - other[0], acc[1] - other[1]]


BUILTIN: dict[str, type[Combiner]] = {"sum": Sum, "count": Count, "min": Min, "max": Max, "mean": Mean}


def combiner(name: str) -> Combiner:
    """The combiner named in a pipeline config (a builtin or ``module:Class``)."""
    if name in BUILTIN:
        return BUILTIN[name]()
    module, sep, cls_name = name.partition(":")
    if not sep:
        raise ValueError(f"unknown aggregation {name!r}: use {', '.join(BUILTIN)} or 'module:Class'")
    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Combiner)):
        raise ValueError(f"{name} is not a millpond.model.aggregations.Combiner")
    return cls()


def output_value_type(comb: Combiner, value_type: str) -> str:
    """'int' or 'float' (the pipeline's vocabulary): the type of the values this combiner emits."""
    kind = comb.output_type
    if kind == "input":
        kind = value_type
    return "int" if kind == "int" else "float"
