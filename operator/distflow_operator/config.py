"""Operator settings: from command-line flags (``distflow-operator``) or, when
the handlers are loaded by ``kopf run`` / ``KopfRunner``, from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    metrics_port: int = 0
    """Port of the operator's /metrics (0: not served)."""
    progress_interval_s: float = 15.0
    """How often node 0 of each running job is scraped for progress."""
    resync_interval_s: float = 60.0
    """How often every job is reconciled even without events."""
    api_workers: int = 16
    """Threads making API calls (pods of one job are created in parallel)."""
    api_qps: float = 20.0
    """Sustained API calls per second, all threads together (client-go's QPS; controller-runtime's 20)."""
    api_burst: int = 30
    """API calls allowed at once above ``api_qps`` (client-go's burst)."""
    leader_election_namespace: str = ""
    """Namespace of the Lease replicas elect a leader with ("": no election, one replica)."""
    lease_duration_s: float = 15.0
    """Seconds a leader's Lease is valid without renewal: how long a killed leader is missed."""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port}: use 0 (off) or a port up to 65535")
        if self.progress_interval_s <= 0 or self.resync_interval_s <= 0:
            raise ValueError("progress_interval_s and resync_interval_s must be > 0 seconds")
        if self.lease_duration_s < 1:
            raise ValueError(f"lease_duration_s={self.lease_duration_s}: must be >= 1 second")
        if self.api_qps <= 0 or self.api_burst < 1:
            raise ValueError(f"api_qps={self.api_qps}, api_burst={self.api_burst}: need qps > 0 and burst >= 1")
        if self.api_workers < 1:
            raise ValueError(f"api_workers={self.api_workers}: must be >= 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ,
                 defaults: "OperatorConfig | None" = None) -> "OperatorConfig":
        """DISTFLOW_OPERATOR_{METRICS_PORT,PROGRESS_INTERVAL,RESYNC_INTERVAL,API_WORKERS,API_QPS,
        API_BURST,LEADER_ELECTION_NAMESPACE,LEASE_DURATION}; an unset variable keeps ``defaults``' value.

        Raises:
            ValueError: a variable is not a number, or out of range.
        """
        def get(name: str, kind: type, default: float | int):
            raw = environ.get(f"DISTFLOW_OPERATOR_{name}")
            try:
                return kind(raw) if raw not in (None, "") else default
            except ValueError:
                raise ValueError(f"DISTFLOW_OPERATOR_{name}={raw!r}: expected a {kind.__name__}") from None

        defaults = defaults or cls()
        return cls(metrics_port=get("METRICS_PORT", int, defaults.metrics_port),
                   progress_interval_s=get("PROGRESS_INTERVAL", float, defaults.progress_interval_s),
                   resync_interval_s=get("RESYNC_INTERVAL", float, defaults.resync_interval_s),
                   api_workers=get("API_WORKERS", int, defaults.api_workers),
                   api_qps=get("API_QPS", float, defaults.api_qps),
                   api_burst=get("API_BURST", int, defaults.api_burst),
                   leader_election_namespace=environ.get("DISTFLOW_OPERATOR_LEADER_ELECTION_NAMESPACE")
                   or defaults.leader_election_namespace,
                   lease_duration_s=get("LEASE_DURATION", float, defaults.lease_duration_s))
