"""How training progress reaches the job's status: the operator scrapes node 0.

Choice, by least privilege. Node 0 already serves Prometheus metrics on its
``metrics`` port (``distflow_step``, ``distflow_throughput_tokens_per_second``,
``distflow_step_duration_seconds``, ``distflow_checkpoint_step``); the
operator reads them over HTTP every few seconds while the job runs. The alternatives need the pods to hold API rights:

- pods patching the RLPostTrainJob's status: every pod could then rewrite any
  job's status in the namespace;
- pods patching an annotation on their own Pod: RBAC cannot say "own pod", so
  each pod could patch every pod in the namespace (labels, even the image).

With scraping the node pods need no Kubernetes credentials at all (they run
with ``automountServiceAccountToken: false``), and the operator needs nothing
beyond network reach to the pods, which a Prometheus already has. Final
outcomes need no scraping either: the node's exit code and termination message
land in the pod status, which the operator watches anyway.

Scrape failures are not errors: the status keeps the last progress it had.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PROGRESS_SERIES = {
    "distflow_step": ("step", int),
    "distflow_throughput_tokens_per_second": ("tokensPerSecond", float),
    "distflow_step_duration_seconds": ("stepSeconds", float),
    "distflow_checkpoint_step": ("lastCheckpointStep", int),
}
"""Node metric -> (status.progress field, type)."""
SCRAPE_TIMEOUT_S = 2.0


def parse_progress(text: str) -> dict[str, Any]:
    """Progress fields from a Prometheus text exposition (missing series are left out).

    When a series has several samples (labels), the largest value is taken.

    Raises:
        ValueError: the text is not a Prometheus exposition.
    """
    found: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in PROGRESS_SERIES:
                continue
            field, kind = PROGRESS_SERIES[sample.name]
            value = kind(round(sample.value, 3)) if kind is float else kind(sample.value)
            found[field] = max(found.get(field, value), value)
    return found


async def scrape_progress(session: aiohttp.ClientSession, pod_ip: str, port: int) -> dict[str, Any] | None:
    """GET http://<pod_ip>:<port>/metrics and parse it; None when unreachable or unparsable."""
    url = f"http://{pod_ip}:{port}/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as response:
            if response.status != 200:
                return None
            return parse_progress(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None
