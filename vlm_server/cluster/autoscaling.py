"""Ray Serve autoscaling on the replicas' own count of requests in flight.

Ray Serve's default policy counts the requests that pass through its own proxies and handles;
the gateway's requests go straight to each replica's doors, so Ray would see idle replicas.
Each replica reports its server's in-flight count instead (`record_autoscaling_stats`, both
doors' requests, whichever way they came), and this policy asks for enough replicas to hold
them at ``target_ongoing_requests`` each. Ray applies its bounds, factors and delays around it.
"""

from __future__ import annotations

from typing import Any

METRIC = "in_flight"
POLICY = "vlm_server.cluster.autoscaling:in_flight_policy"


def in_flight_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas: the requests the replicas hold over the target per replica."""
    running = ctx.current_num_replicas
    if running == 0:
        return ctx.target_num_replicas, {}
    held = sum(((ctx.aggregated_metrics or {}).get(METRIC) or {}).values())
    target = ctx.config.get_target_ongoing_requests()
    return (held / target if target > 0 else running), {}
