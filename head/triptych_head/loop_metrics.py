"""Counters and histograms that only the head's loop thread updates, kept as plain numbers.

prometheus_client guards every value with a lock and walks a histogram's buckets in Python: 1-3 µs
an update, and the loop thread makes ~25 of them per request (the stage, queue, transfer and
request times, the messages sent). Plain numbers take the decision core from 111 to 96 µs per
request (bench/core_bench.py; docs/benchmarks.md, "The head's wait and its metrics"). Each child
keeps its numbers in a list that the one thread writing them adds to, and the family hands them to
the same registry when /metrics is read (on the API's thread). A scrape copies each child's numbers
at once, so it sees whole updates; between a histogram's bucket and its sum it may see one
observation in the first and not yet in the second, as prometheus_client's own histograms may.

Only for metrics that one thread alone updates: two writers could lose increments. The exposition
is prometheus_client's for the same metric (names, `_total`, `le` labels), less the optional
`_created` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class _Family:
    """A metric's children by label values, registered as a collector."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], list[float]] = {}
        registry.register(self)

    def _child(self, values: tuple[str, ...]) -> list[float]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        found = self._children.get(values)
        if found is None:
            found = self._children[values] = self._new()
        return found

    def _new(self) -> list[float]:
        raise NotImplementedError

    def _snapshot(self) -> list[tuple[tuple[str, ...], list[float]]]:
        # dict.items() and list() are each one step under the GIL: whole children, whole updates.
        return [(values, list(numbers)) for values, numbers in list(self._children.items())]

    def describe(self) -> list[Metric]:
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        return self._families(self._snapshot())

    def _families(self, children: list[tuple[tuple[str, ...], list[float]]]) -> Iterator[Metric]:
        raise NotImplementedError


class CounterChild:
    __slots__ = ("_numbers",)

    def __init__(self, numbers: list[float]):
        self._numbers = numbers

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up; got {amount}")
        self._numbers[0] += amount


class LoopCounter(_Family):
    """prometheus_client's Counter for one writing thread: `labels(*values).inc(n)`, or `inc(n)` unlabelled."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry):
        super().__init__(name, documentation, labelnames, registry)
        self._own = CounterChild(self._child(())) if not self.labelnames else None

    def _new(self) -> list[float]:
        return [0.0]

    def labels(self, *values: str) -> CounterChild:
        return CounterChild(self._child(values))

    def inc(self, amount: float = 1.0) -> None:
        if self._own is None:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use labels(...).inc()")
        self._own.inc(amount)

    def _families(self, children: list[tuple[tuple[str, ...], list[float]]]) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, (value,) in children:
            family.add_metric(list(values), value)
        yield family


class HistogramChild:
    __slots__ = ("_numbers", "_sum_at", "bounds")

    def __init__(self, bounds: tuple[float, ...], numbers: list[float]):
        self.bounds = bounds
        self._numbers = numbers  # per bucket (not cumulative), the last +Inf; then the sum
        self._sum_at = len(bounds) + 1

    def observe(self, amount: float) -> None:
        numbers = self._numbers
        numbers[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount: le semantics
        numbers[self._sum_at] += amount


class LoopHistogram(_Family):
    """prometheus_client's Histogram for one writing thread: `labels(*values).observe(x)`, or `observe(x)`."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ):
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"{name}: buckets must be increasing, got {tuple(buckets)}")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry)
        self._own = HistogramChild(bounds, self._child(())) if not self.labelnames else None

    def _new(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 2)

    def labels(self, *values: str) -> HistogramChild:
        return HistogramChild(self.bounds, self._child(values))

    def observe(self, amount: float) -> None:
        if self._own is None:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use labels(...).observe()")
        self._own.observe(amount)

    def _families(self, children: list[tuple[tuple[str, ...], list[float]]]) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for values, numbers in children:
            cumulative, buckets = 0.0, []
            for le, count in zip(les, numbers, strict=False):  # numbers ends with the sum
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(values), buckets, numbers[-1])
        yield family
