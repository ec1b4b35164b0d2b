"""The ddtree Grafana dashboard, declared with grafana-foundation-sdk's typed builders.

Every panel has a unit and a description; every query filters on the dashboard's variables
(application, deployment, replica: the tags Ray Serve puts on every Serve metric). Metric names
are the engine's (serve/metrics.py) and Ray Serve's own, as Ray exports them (prefix `ray_`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

DASHBOARD_UID = "ddtree-overview"
DATASOURCE_UID = "ddtree-prometheus"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
SELECTOR = 'application=~"$application",deployment=~"$deployment",replica=~"$replica"'
INGRESS_SELECTOR = 'application=~"$application"'
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    width: int = 12


def _rate(metric: str, by: str = "", selector: str = SELECTOR) -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{selector}}}{RATE}))"


def _quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"histogram_quantile({q}, {_rate(metric + '_bucket', 'le')})", f"p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    )


PANELS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Output tokens/s", "suffix: tok/s",
        "Completion tokens emitted per second (accepted drafted tokens + bonus tokens), all replicas.",
        ((_rate("ray_ddtree_output_tokens_total"), "tokens/s"),),
    ),
    PanelSpec(
        "Tau (tokens per round)", "short",
        "Mean output tokens per speculative round: 1 + accepted drafted tokens per round. 1 means "
        "the drafter never helps; the block size is the ceiling.",
        ((f"1 + {_rate('ray_ddtree_accepted_length_sum')} / {_rate('ray_ddtree_accepted_length_count')}", "tau"),),
    ),
    PanelSpec(
        "Time to first token", "s",
        "Arrival at the engine to the first output token, p50 / p90 / p99.",
        _quantiles("ray_ddtree_time_to_first_token_seconds"),
    ),
    PanelSpec(
        "Inter-token latency", "s",
        "Time between consecutive output tokens of a request, p50 / p90 / p99.",
        _quantiles("ray_ddtree_inter_token_latency_seconds"),
    ),
    PanelSpec(
        "Acceptance per draft depth", "percentunit",
        "Share of rounds whose accepted path reaches each draft depth: how far into the block "
        "the drafter stays right.",
        ((f"{_rate('ray_ddtree_accepted_tokens_total', 'depth')} / scalar({_rate('ray_ddtree_rounds_total')})",
          "depth {{depth}}"),),
    ),
    PanelSpec(
        "Accepted tokens by source", "short",
        "Drafted tokens accepted per second, by who proposed them: the drafter, the lookup branch "
        "(prompt lookup, no drafter work) or both at the same place.",
        ((_rate("ray_ddtree_accepted_tokens_by_source_total", "source"), "{{source}}"),),
    ),
    PanelSpec(
        "Granted budget", "short",
        "Drafted nodes granted per round, p50 / p90 / p99: 0 is plain decoding. Under budget auto "
        "the policy grants what maximizes the batch's tokens/s for this step's load.",
        _quantiles("ray_ddtree_granted_budget"),
    ),
    PanelSpec(
        "Budget policy: predicted vs realized acceptance", "short",
        "Budget auto: drafted tokens per second the policy expected to be accepted, and those "
        "accepted; their ratio far from 1 means its acceptance model is off.",
        ((_rate("ray_ddtree_policy_predicted_accepted_sum"), "predicted"),
         (_rate("ray_ddtree_policy_accepted_sum"), "realized"),
         (f"{_rate('ray_ddtree_policy_predicted_accepted_sum')} / {_rate('ray_ddtree_policy_accepted_sum')}",
          "predicted / realized")),
    ),
    PanelSpec(
        "Budget policy: probes", "short",
        "Budget auto: rounds per second that drafted to learn a sequence's gains (a probe: its first "
        "step, then after 8, 16, ... plain steps), against all auto rounds. Probes that are rarely "
        "followed by drafting are cut back per band of batch sizes; many probes under load mean "
        "learning costs throughput.",
        ((_rate("ray_ddtree_policy_probes_total"), "probes"),
         (_rate("ray_ddtree_policy_accepted_count"), "auto rounds")),
    ),
    PanelSpec(
        "Budget policy: step-cost re-measurements", "short",
        "Budget auto: times each replica measured the target's step cost T(r) again since it started, "
        "because its forwards took over 2x (or under half) what the curve predicted for 8 steps in a "
        "row (16 after the first time, ...). A count that keeps rising means the machine's speed keeps "
        "changing under the replica (another process on its cores).",
        ((f"max by (replica) (ray_ddtree_policy_recalibrations{{{SELECTOR}}})", "{{replica}}"),),
    ),
    PanelSpec(
        "Round time by phase", "s",
        "Mean seconds per round in each phase: draft (drafter pass), tree (build), verify "
        "(target pass over the tree), commit (walk, KV compaction, stop checks).",
        ((f"{_rate('ray_ddtree_round_phase_seconds_sum', 'phase')} / {_rate('ray_ddtree_round_phase_seconds_count', 'phase')}",
          "{{phase}}"),),
    ),
    PanelSpec(
        "CUDA graphs", "short",
        "Per replica: the verify forwards captured as CUDA graphs at start-up (0 on the CPU or with "
        "cuda_graphs off), and the served verify steps that ran eagerly since it started, outside every "
        "graph (more sequences, rows or context than any graph holds). Eager steps that keep rising "
        "mean the captured buckets miss this load.",
        ((f"max by (replica) (ray_ddtree_cuda_graphs_captured{{{SELECTOR}}})", "captured {{replica}}"),
         (f"max by (replica) (ray_ddtree_cuda_graphs_eager_steps{{{SELECTOR}}})", "eager steps {{replica}}")),
    ),
    PanelSpec(
        "Requests running and queued", "short",
        "Requests generating, and requests waiting for their first step, summed over replicas.",
        ((f"sum(ray_ddtree_requests_running{{{SELECTOR}}})", "running"),
         (f"sum(ray_ddtree_requests_queued{{{SELECTOR}}})", "queued")),
    ),
    PanelSpec(
        "Engine replicas", "short",
        "Engine replicas reporting metrics (one replica = one model instance).",
        ((f"count(count by (replica) (ray_ddtree_requests_running{{{SELECTOR}}}))", "replicas"),),
    ),
    PanelSpec(
        "Errors by status code", "reqps",
        "HTTP requests answered with an error, per second, by status code (Ray Serve's proxy).",
        ((f"sum by (error_code) (rate(ray_serve_num_http_error_requests_total{{{INGRESS_SELECTOR}}}{RATE}))",
          "{{error_code}}"),),
        width=24,
    ),
)


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )


def build_dashboard() -> gd.Dashboard:
    builder = (
        gd.Dashboard("ddtree — speculative decoding")
        .uid(DASHBOARD_UID)
        .description("Throughput, latency and acceptance of a ddtree (DFlash + DDTree) Serve application.")
        .tags(["ddtree", "ray-serve", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(_variable("application", "Application", "label_values(ray_ddtree_requests_running, application)"))
        .with_variable(_variable("deployment", "Deployment",
                                 'label_values(ray_ddtree_requests_running{application=~"$application"}, deployment)'))
        .with_variable(_variable("replica", "Replica",
                                 'label_values(ray_ddtree_requests_running{application=~"$application",deployment=~"$deployment"}, replica)'))
    )
    for spec in PANELS:
        panel = (
            timeseries.Panel()
            .title(spec.title)
            .description(spec.description)
            .unit(spec.unit)
            .datasource(DATASOURCE)
            .height(8)
            .span(spec.width)
        )
        for ref, (expr, legend) in zip("ABCDEFGH", spec.queries):
            panel = panel.with_target(
                prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
            )
        builder = builder.with_panel(panel)
    return builder


def dashboard_json() -> dict:
    """The dashboard model as Grafana's JSON (a dict), through the SDK's own encoder."""
    return json.loads(json.dumps(build_dashboard().build(), cls=JSONEncoder))


def promql_expressions(model: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    model = model or dashboard_json()
    exprs = [t["expr"] for p in model.get("panels", []) for t in p.get("targets", [])]
    for var in model.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query if isinstance(query, str) else query.get("query", ""))
    return exprs
