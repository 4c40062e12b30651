"""``distflow-operator``: run the operator (kopf) against the current cluster.

    distflow-operator                       # all namespaces; metrics :8080, liveness :8081/healthz
    distflow-operator -n team-a -n team-b   # only these namespaces

Every setting but the namespaces may also come from ``DISTFLOW_OPERATOR_*``
(config.py); a flag given on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping

from distflow_operator.config import OperatorConfig


CLI_DEFAULTS = OperatorConfig(metrics_port=8080)


def _parser(environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """Flags whose defaults are the environment's settings (a variable the chart's extraEnv sets
    must not be overridden by a flag nobody gave)."""
    defaults = OperatorConfig.from_env(environ, CLI_DEFAULTS)
    parser = argparse.ArgumentParser(prog="distflow-operator", description="The RLPostTrainJob operator.")
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port, help="operator /metrics port (0: off)")
    parser.add_argument("--liveness-port", type=int, default=8081, help="/healthz port (0: off)")
    parser.add_argument("--progress-interval", type=float, default=defaults.progress_interval_s,
                        help="seconds between progress scrapes of node 0")
    parser.add_argument("--resync-interval", type=float, default=defaults.resync_interval_s,
                        help="seconds between full resyncs")
    parser.add_argument("--api-workers", type=int, default=defaults.api_workers,
                        help="threads making API calls")
    parser.add_argument("--api-qps", type=float, default=defaults.api_qps,
                        help="API calls per second, sustained (client-side rate limit)")
    parser.add_argument("--api-burst", type=int, default=defaults.api_burst,
                        help="API calls allowed at once above --api-qps")
    parser.add_argument("--leader-election-namespace", default=defaults.leader_election_namespace,
                        help="elect a leader through a Lease in this namespace (run several replicas)")
    parser.add_argument("--lease-duration", type=float, default=defaults.lease_duration_s,
                        help="seconds a leader's Lease lasts without renewal")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        config = OperatorConfig(metrics_port=args.metrics_port, progress_interval_s=args.progress_interval,
                                resync_interval_s=args.resync_interval, api_workers=args.api_workers,
                                api_qps=args.api_qps, api_burst=args.api_burst,
                                leader_election_namespace=args.leader_election_namespace,
                                lease_duration_s=args.lease_duration)
    except ValueError as err:
        print(f"distflow-operator: {err}", file=sys.stderr)
        return 2
    import kopf

    import distflow_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("distflow_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=liveness, memo=kopf.Memo(config=config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
