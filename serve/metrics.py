"""The engine's metrics, through `ray.serve.metrics` (exported on Ray's Prometheus endpoint with
Ray's `ray_` prefix, e.g. `ray_ddtree_accepted_tokens_total`)."""

from __future__ import annotations

import threading
import time

from ray.serve import metrics

from ..workers.requests import PHASES as ROUND_PHASES

LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
ACCEPTED_BOUNDARIES = [0.5 + i for i in range(32)]  # bucket i holds an accepted length of i
# granted budgets: 0 (plain), 1, 2, 4, ... (a bucket Q holds Q - 1 drafted nodes)
BUDGET_BOUNDARIES = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5, 256.5, 512.5, 1024.5]
# The round phases the step loop times (workers.requests.PHASES but transport, which only the
# solo loop separates: the step loop's verify time includes any transport).
PHASES = tuple(p for p in ROUND_PHASES if p != "transport")
# Ray's metrics agent keeps a gauge's value for two report intervals (2 x 10 s by default) after
# the process last set it: a value set once is gone from the endpoint within half a minute.
KERNEL_INFO_REFRESH_S = 5.0


class EngineMetrics:
    def __init__(self, model: str):
        tags = {"model": model}

        def tagged(metric):
            metric.set_default_tags(dict(tags))  # Ray adds its own tags to the dict it gets
            return metric

        self.drafted = tagged(metrics.Counter(
            "ddtree_drafted_tokens", description="Drafted tree nodes verified, by draft depth.",
            tag_keys=("model", "depth")))
        self.accepted = tagged(metrics.Counter(
            "ddtree_accepted_tokens", description="Drafted tokens the target accepted, by draft depth.",
            tag_keys=("model", "depth")))
        self.accepted_by_source = tagged(metrics.Counter(
            "ddtree_accepted_tokens_by_source", description="Drafted tokens the target accepted, by who "
            "proposed them: drafter, lookup (the lookup branch alone) or both.", tag_keys=("model", "source")))
        self.emitted = tagged(metrics.Counter(
            "ddtree_output_tokens", description="Completion tokens emitted (accepted + bonus).",
            tag_keys=("model",)))
        self.rounds = tagged(metrics.Counter(
            "ddtree_rounds", description="Speculative rounds run.", tag_keys=("model",)))
        self.accepted_length = tagged(metrics.Histogram(
            "ddtree_accepted_length", description="Drafted tokens accepted per round.",
            boundaries=ACCEPTED_BOUNDARIES, tag_keys=("model",)))
        self.granted = tagged(metrics.Histogram(
            "ddtree_granted_budget", description="Drafted nodes granted per round (0 = plain decoding; "
            "a chain counts its depths).", boundaries=BUDGET_BOUNDARIES, tag_keys=("model",)))
        # histograms, not counters: a round of plain decoding predicts and accepts 0, which a
        # counter cannot add, and the two must count the same rounds
        self.policy_predicted = tagged(metrics.Histogram(
            "ddtree_policy_predicted_accepted", description="Budget auto: drafted tokens the policy expected "
            "a round to accept.", boundaries=ACCEPTED_BOUNDARIES, tag_keys=("model",)))
        self.policy_accepted = tagged(metrics.Histogram(
            "ddtree_policy_accepted", description="Budget auto: drafted tokens a round accepted.",
            boundaries=ACCEPTED_BOUNDARIES, tag_keys=("model",)))
        self.policy_probes = tagged(metrics.Counter(
            "ddtree_policy_probes", description="Budget auto: rounds that drafted a sequence's first tree, its "
            "acceptance still unknown.", tag_keys=("model",)))
        self.ttft = tagged(metrics.Histogram(
            "ddtree_time_to_first_token_seconds", description="Arrival to first token, seconds.",
            boundaries=LATENCY_BOUNDARIES_S, tag_keys=("model",)))
        self.itl = tagged(metrics.Histogram(
            "ddtree_inter_token_latency_seconds", description="Time between output tokens, seconds.",
            boundaries=LATENCY_BOUNDARIES_S, tag_keys=("model",)))
        self.phase = tagged(metrics.Histogram(
            "ddtree_round_phase_seconds", description="Round time by phase (draft, tree, verify, commit), seconds.",
            boundaries=LATENCY_BOUNDARIES_S, tag_keys=("model", "phase")))
        self.running_gauge = tagged(metrics.Gauge(
            "ddtree_requests_running", description="Requests generating on this replica.", tag_keys=("model",)))
        self.queued_gauge = tagged(metrics.Gauge(
            "ddtree_requests_queued", description="Requests waiting for their first step.", tag_keys=("model",)))
        self.errors = tagged(metrics.Counter(
            "ddtree_request_errors", description="Requests refused by the engine, by HTTP status.",
            tag_keys=("model", "status")))
        self.recalibrations = tagged(metrics.Gauge(
            "ddtree_policy_recalibrations", description="Budget auto: times the live steps contradicted the "
            "target's step-cost curve and the scheduler measured it again, since the replica started.",
            tag_keys=("model",)))
        self.kernel_backend = tagged(metrics.Gauge(
            "ddtree_kernel_backend_info", description="1 for the backends that run the target's linears and "
            "attention on this replica: linear float_mm / blocks_mm and attention tree_attention are ddtree's "
            "bitwise CPU kernels; onednn, torch and sdpa are the fallback (docs/cpu-kernels.md).",
            tag_keys=("model", "linear", "attention", "bitwise")))
        self.graphs_captured = tagged(metrics.Gauge(
            "ddtree_cuda_graphs_captured", description="Verify forwards captured as CUDA graphs at start-up, one per "
            "(batch bucket, row bucket) (0: cuda_graphs off, or not on CUDA).", tag_keys=("model",)))
        self.graphs_seconds = tagged(metrics.Gauge(
            "ddtree_cuda_graphs_capture_seconds", description="Seconds capturing the CUDA graphs took at start-up.",
            tag_keys=("model",)))
        self.graphs_bytes = tagged(metrics.Gauge(
            "ddtree_cuda_graphs_memory_bytes", description="GPU memory the CUDA graphs hold, in bytes.",
            tag_keys=("model",)))
        self.graphs_eager = tagged(metrics.Gauge(
            "ddtree_cuda_graphs_eager_steps", description="Verify steps that ran eagerly, outside the captured "
            "CUDA graphs (more sequences, other rows or a longer context than any graph holds), since the "
            "replica started serving (0 without graphs).", tag_keys=("model",)))
        self.eager_total = 0  # what graphs_eager shows: set by eager_steps, again by set_kernels' thread
        self.running_gauge.set(0)
        self.queued_gauge.set(0)
        self.recalibrations.set(0)

    def set_batch(self, running: int, queued: int, recalibrations: int = 0) -> None:
        """The scheduler's batch after a step: sequences running, requests waiting, and the budget
        policy's re-measurements so far."""
        self.running_gauge.set(running)
        self.queued_gauge.set(queued)
        self.recalibrations.set(recalibrations)

    def set_kernels(self, backends, graphs=None) -> None:
        """The engine's workers.model.KernelBackends and its CUDA graphs' workers.graphs.GraphStats
        (None: none captured), from start-up on: set again every KERNEL_INFO_REFRESH_S on a
        thread of its own, since a gauge that is not set again leaves Ray's endpoint (a replica
        that served no request would lose it)."""
        tags = {"linear": backends.linear, "attention": backends.attention, "bitwise": str(backends.bitwise).lower()}
        captured, seconds, size = (graphs.captured, graphs.seconds, graphs.bytes) if graphs is not None else (0, 0.0, 0)

        def refresh():
            while True:
                self.kernel_backend.set(1, tags=tags)
                self.graphs_captured.set(captured)
                self.graphs_seconds.set(seconds)
                self.graphs_bytes.set(size)
                self.graphs_eager.set(self.eager_total)
                time.sleep(KERNEL_INFO_REFRESH_S)

        threading.Thread(target=refresh, name="ddtree-kernel-info", daemon=True).start()

    def eager_steps(self, total: int) -> None:
        """`total` verify steps have run outside the captured CUDA graphs since serving began."""
        if total != self.eager_total:
            self.eager_total = total
            self.graphs_eager.set(total)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def output_tokens(self, n: int) -> None:
        if n:
            self.emitted.inc(n)

    def error(self, status: int) -> None:
        self.errors.inc(tags={"status": str(status)})

    def round(self, stats) -> None:
        self.rounds.inc()
        self.accepted_length.observe(stats.accepted)
        self.granted.observe(stats.tree_size - 1 if stats.budget in (None, "chain") else stats.budget)
        if stats.predicted is not None:  # a round of the budget policy
            self.policy_predicted.observe(stats.predicted)
            self.policy_accepted.observe(stats.accepted)
        if stats.probe:
            self.policy_probes.inc()
        for depth, count in enumerate(stats.drafted_per_depth, start=1):
            self.drafted.inc(count, tags={"depth": str(depth)})
            if depth <= stats.accepted:
                self.accepted.inc(tags={"depth": str(depth)})
        for source, count in zip(("drafter", "lookup", "both"), stats.accepted_sources):
            if count:
                self.accepted_by_source.inc(count, tags={"source": source})
        for phase in PHASES:
            self.phase.observe(getattr(stats, f"{phase}_s"), tags={"phase": phase})
