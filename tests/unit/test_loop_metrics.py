"""The loop thread's counters and histograms (head/triptych_head/loop_metrics.py) read as
prometheus_client's own would: the same exposition for the same updates, less `_created`."""

from __future__ import annotations

import random
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from triptych_head.loop_metrics import LoopCounter, LoopHistogram
from triptych_head.metrics import LATENCY_BUCKETS, HeadMetrics


def _exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_the_exposition_is_prometheus_clients_for_the_same_updates() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    pairs = [
        (Counter("c_labelled", "a counter", ["role"], registry=theirs),
         LoopCounter("c_labelled", "a counter", ["role"], registry=ours)),
        (Counter("c_plain", "a plain counter", registry=theirs),
         LoopCounter("c_plain", "a plain counter", registry=ours)),
    ]  # fmt: skip
    hists = [
        (Histogram("h_labelled", "a histogram", ["src", "dst"], buckets=LATENCY_BUCKETS, registry=theirs),
         LoopHistogram("h_labelled", "a histogram", ["src", "dst"], buckets=LATENCY_BUCKETS, registry=ours)),
        (Histogram("h_plain", "a plain one", buckets=(0.1, 1, 10), registry=theirs),
         LoopHistogram("h_plain", "a plain one", buckets=(0.1, 1, 10), registry=ours)),
    ]  # fmt: skip
    rng = random.Random(7)
    # Values on the bounds themselves belong to that bucket (le), both ways.
    values = [0.005, 0.1, 1.0, 10.0, 600.0, 601.0, 0.0, *(rng.uniform(0, 700) for _ in range(300))]
    for i, value in enumerate(values):
        role = ("encoder", "denoiser")[i % 2]
        for theirs_c, ours_c in pairs:
            if theirs_c._labelnames:
                theirs_c.labels(role).inc(value)
                ours_c.labels(role).inc(value)
            else:
                theirs_c.inc(value)
                ours_c.inc(value)
        for theirs_h, ours_h in hists:
            if theirs_h._labelnames:
                theirs_h.labels(role, "decoder").observe(value)
                ours_h.labels(role, "decoder").observe(value)
            else:
                theirs_h.observe(value)
                ours_h.observe(value)
    assert _exposition(ours) == _exposition(theirs)


def test_a_value_on_a_bound_counts_in_that_bucket_and_unlabelled_metrics_start_at_zero() -> None:
    registry = CollectorRegistry()
    hist = LoopHistogram("h", "h", buckets=(0.1, 1), registry=registry)
    count = LoopCounter("c", "c", registry=registry)
    assert registry.get_sample_value("c_total") == 0
    assert registry.get_sample_value("h_count") == 0
    for value in (0.1, 1, 1.5):
        hist.observe(value)
    count.inc()
    assert registry.get_sample_value("h_bucket", {"le": "0.1"}) == 1
    assert registry.get_sample_value("h_bucket", {"le": "1.0"}) == 2
    assert registry.get_sample_value("h_bucket", {"le": "+Inf"}) == 3
    assert registry.get_sample_value("h_sum") == pytest.approx(2.6)
    assert registry.get_sample_value("c_total") == 1


def test_misuse_is_refused_with_the_metric_named() -> None:
    registry = CollectorRegistry()
    labelled = LoopCounter("c", "c", ["role"], registry=registry)
    with pytest.raises(ValueError, match=r"c takes labels \('role',\)"):
        labelled.labels("a", "b")
    with pytest.raises(ValueError, match="has labels"):
        labelled.inc()
    with pytest.raises(ValueError, match="only go up"):
        labelled.labels("a").inc(-1)
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("h", "h", buckets=(1, 0.5), registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopCounter("c", "again", registry=registry)


def test_a_scrape_while_the_loop_thread_observes_sees_whole_observations() -> None:
    registry = CollectorRegistry()
    hist = LoopHistogram("h", "h", ["role"], buckets=(0.5,), registry=registry).labels("encoder")
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            for _ in range(1000):
                hist.observe(0.25)
                hist.observe(0.75)

    writer = threading.Thread(target=observe)
    writer.start()
    changed, last, deadline = 0, -1.0, time.monotonic() + 5
    try:
        while changed < 20 and time.monotonic() < deadline:  # scrapes that fell between observations
            samples = {s.name + s.labels.get("le", ""): s.value for m in registry.collect() for s in m.samples}
            assert samples["h_count"] == samples["h_bucket+Inf"]
            below, above = samples["h_bucket0.5"], samples["h_bucket+Inf"] - samples["h_bucket0.5"]
            assert above in (below, below - 1)  # observed in pairs: 0.25 then 0.75
            changed += samples["h_count"] != last
            last = samples["h_count"]
            time.sleep(0.001)  # lets the writer run
    finally:
        stop.set()
        writer.join(10)
    assert changed >= 20


def test_the_heads_metrics_registry_holds_them_beside_prometheus_clients_own() -> None:
    metrics = HeadMetrics()
    metrics.child(metrics.stage_seconds, "encoder").observe(0.02)
    metrics.child(metrics.worker_messages, "work").inc()
    metrics.retries.labels("encoder", "heartbeat_lost").inc()  # a prometheus_client counter
    text = generate_latest(metrics.registry).decode()
    assert 'triptych_stage_seconds_bucket{le="0.025",role="encoder"} 1.0' in text
    assert 'triptych_worker_messages_sent_total{type="work"} 1.0' in text
    assert 'triptych_retries_total{cause="heartbeat_lost",role="encoder"} 1.0' in text
