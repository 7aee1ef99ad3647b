"""One Prometheus page from the /metrics pages of several replicas (``bole serve --replicas``).

Two views. The aggregate (``GET /metrics`` at Ray Serve's proxy) is what a router or a scraper
sees at the one address in front of every replica: counters, histograms and the request gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, Bole's twins) are summed over the
replicas, the cache-usage shares (``vllm:gpu_cache_usage_perc``, ``bole_cache_usage_ratio``) are
averaged (every replica has the same slots, so the mean is the share of all slots in use), and a
``*_created`` timestamp is the earliest. The per-replica view (``GET /metrics?by=replica``) keeps
every replica's samples apart under a ``replica`` label. Both add ``bole_replicas``, the number
of replicas that answered. The ingress's page (the HTTP responses it answered, the requests it
re-sent) is merged in as one more page, not counted as a replica.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MEAN_GAUGES", "REPLICA_LABEL", "merge_metrics"]

#: gauges that are shares of a replica's slots: averaged, not summed
MEAN_GAUGES = frozenset({"vllm:gpu_cache_usage_perc", "bole_cache_usage_ratio"})
#: the label of the per-replica view
REPLICA_LABEL = "replica"


class _Fixed:
    """A collector of ready-made families (what generate_latest renders)."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def _combine(family: str, sample: str, values: list[float]) -> float:
    if sample.endswith("_created"):
        return min(values)
    if family in MEAN_GAUGES:
        return sum(values) / len(values)
    return sum(values)


def merge_metrics(pages: Mapping[str, str | bytes], by_replica: bool = False,
                  extra: Mapping[str, str | bytes] | None = None) -> bytes:
    """The aggregate of ``pages`` (replica id -> its /metrics text), or with ``by_replica`` every
    replica's samples labelled with its id; in Prometheus' text format. ``extra``: pages merged
    the same way that are not replicas' (the ingress's HTTP counters)."""
    families: dict[str, Metric] = {}
    samples: dict[str, dict[tuple, list[float]]] = {}       # family -> (name, labels) -> values
    for replica, page in sorted({**pages, **(extra or {})}.items()):
        text = page.decode() if isinstance(page, bytes) else page
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            bucket = samples.setdefault(fam.name, {})
            for s in fam.samples:
                labels = dict(s.labels, **({REPLICA_LABEL: replica} if by_replica else {}))
                bucket.setdefault((s.name, tuple(sorted(labels.items()))), []).append(s.value)
    out = []
    for name, fam in families.items():
        for (sample, labels), values in samples[name].items():
            fam.add_sample(sample, dict(labels), _combine(name, sample, values))
        out.append(fam)
    count = Metric("bole_replicas", "Replicas whose metrics this page holds", "gauge")
    count.add_sample("bole_replicas", {}, float(len(pages)))
    out.append(count)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(out))
    return generate_latest(registry)
