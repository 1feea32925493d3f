"""A server's `/metrics`, scraped and read by sample name and labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: A `/metrics` scrape: (sample name, its labels) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(http: httpx.AsyncClient, base: str, **headers: str) -> Samples:
    answer = await http.get(f"{base}/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return parse(answer.text)
