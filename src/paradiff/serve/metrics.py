"""Counters and the latency histogram of `paradiff serve`, rendered as Prometheus text (GET /metrics)."""

from __future__ import annotations

import threading

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[int, int] = {}  # HTTP status -> count
        self.images = 0
        self.steps = 0
        self.pipeline_seconds = 0.0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum = 0.0
        self.rank_memory: dict[int, int] = {}
        self.rank_rss: dict[int, int] = {}
        self.cancelled_requests = 0
        self.cancelled_steps = 0  # denoising steps not run thanks to cancellations
        self.keys = 0
        self.replica_step_count: dict[int, int] = {}  # replica -> denoising steps its output rank timed
        self.replica_step_seconds: dict[int, float] = {}
        self.replica_steps_per_s: dict[int, float] = {}  # the latest rate: live during a call, then the round's

    def request_done(self, status: int, latency_s: float | None = None, images: int = 0, steps: int = 0) -> None:
        with self._lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            self.images += images
            self.steps += steps
            if latency_s is not None:
                index = next((i for i, bound in enumerate(LATENCY_BUCKETS_S) if latency_s <= bound),
                             len(LATENCY_BUCKETS_S))
                self.latency_counts[index] += 1
                self.latency_sum += latency_s

    def pipeline_time(self, seconds: float) -> None:
        with self._lock:
            self.pipeline_seconds += seconds

    def memory(self, per_rank: dict[int, int]) -> None:
        with self._lock:
            self.rank_memory.update(per_rank)

    def rss(self, per_rank: dict[int, int]) -> None:
        with self._lock:
            self.rank_rss.update(per_rank)

    def cancelled(self, requests: int, steps_skipped: int) -> None:
        with self._lock:
            self.cancelled_requests += requests
            self.cancelled_steps += steps_skipped

    def replica_rate(self, replica: int, steps_per_s: float) -> None:
        with self._lock:
            self.replica_steps_per_s[replica] = steps_per_s

    def replica_steps(self, replica: int, step_s: list[float]) -> None:
        """A round's per-step times of one replica (its output rank's step events)."""
        with self._lock:
            self.replica_step_count[replica] = self.replica_step_count.get(replica, 0) + len(step_s)
            self.replica_step_seconds[replica] = self.replica_step_seconds.get(replica, 0.0) + sum(step_s)
            if sum(step_s) > 0:
                self.replica_steps_per_s[replica] = len(step_s) / sum(step_s)

    def store_keys(self, count: int) -> None:
        with self._lock:
            self.keys = count

    def render(self, queued: int, running: int, health: str, queued_cost: float = 0.0,
               expected_wait: float | None = None, replicas: dict[int, str] | None = None,
               replica_running: dict[int, int] | None = None, job_store: tuple[bool, int] = (True, 0)) -> str:
        """`replicas`: replica -> its state ("ready", "busy", "loading", "failed"); `replica_running`: replica -> the
        requests it runs; `job_store`: whether the video jobs' store answers, and the finished jobs' results waiting
        for it."""
        with self._lock:
            lines = ["# HELP paradiff_requests_total Requests answered, by HTTP status.",
                     "# TYPE paradiff_requests_total counter"]
            lines += [f'paradiff_requests_total{{status="{status}"}} {count}'
                      for status, count in sorted(self.requests.items())]
            lines += ["# HELP paradiff_queue_depth Requests waiting for a replica.", "# TYPE paradiff_queue_depth gauge",
                      f"paradiff_queue_depth {queued}",
                      "# HELP paradiff_requests_running Requests a replica is running.",
                      "# TYPE paradiff_requests_running gauge", f"paradiff_requests_running {running}",
                      "# HELP paradiff_images_total Images generated.", "# TYPE paradiff_images_total counter",
                      f"paradiff_images_total {self.images}",
                      "# HELP paradiff_steps_total Denoising steps run (rate() of it is steps/s).",
                      "# TYPE paradiff_steps_total counter", f"paradiff_steps_total {self.steps}",
                      "# HELP paradiff_pipeline_seconds_total Seconds the replicas spent in pipeline calls.",
                      "# TYPE paradiff_pipeline_seconds_total counter",
                      f"paradiff_pipeline_seconds_total {self.pipeline_seconds:.6f}",
                      "# HELP paradiff_request_latency_seconds Time from acceptance to answer of successful requests.",
                      "# TYPE paradiff_request_latency_seconds histogram"]
            cumulative = 0
            for bound, count in zip(LATENCY_BUCKETS_S + (float("inf"),), self.latency_counts):
                cumulative += count
                label = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f'paradiff_request_latency_seconds_bucket{{le="{label}"}} {cumulative}')
            lines += [f"paradiff_request_latency_seconds_sum {self.latency_sum:.6f}",
                      f"paradiff_request_latency_seconds_count {cumulative}",
                      "# HELP paradiff_rank_peak_memory_bytes Peak memory of each rank.",
                      "# TYPE paradiff_rank_peak_memory_bytes gauge"]
            lines += [f'paradiff_rank_peak_memory_bytes{{rank="{rank}"}} {value}'
                      for rank, value in sorted(self.rank_memory.items())]
            lines += ["# HELP paradiff_rank_rss_bytes Resident memory of each rank after its last round.",
                      "# TYPE paradiff_rank_rss_bytes gauge"]
            lines += [f'paradiff_rank_rss_bytes{{rank="{rank}"}} {value}'
                      for rank, value in sorted(self.rank_rss.items())]
            lines += ["# HELP paradiff_requests_cancelled_total Requests whose work stopped early (504, client gone).",
                      "# TYPE paradiff_requests_cancelled_total counter",
                      f"paradiff_requests_cancelled_total {self.cancelled_requests}",
                      "# HELP paradiff_cancelled_steps_total Denoising steps not run because their request was "
                      "cancelled.", "# TYPE paradiff_cancelled_steps_total counter",
                      f"paradiff_cancelled_steps_total {self.cancelled_steps}",
                      "# HELP paradiff_store_keys Keys in the ranks' coordination store after the last round.",
                      "# TYPE paradiff_store_keys gauge", f"paradiff_store_keys {self.keys}"]
            lines += ["# HELP paradiff_queue_cost The cost of the waiting requests (pixels x frames x steps x CFG "
                      "branches x images).", "# TYPE paradiff_queue_cost gauge", f"paradiff_queue_cost {queued_cost:g}",
                      "# HELP paradiff_expected_wait_seconds How long a request sent now is expected to wait (-1: not "
                      "known yet).", "# TYPE paradiff_expected_wait_seconds gauge",
                      f"paradiff_expected_wait_seconds {-1 if expected_wait is None else round(expected_wait, 3):g}"]
            lines += ["# HELP paradiff_replica_up 1 while the replica serves (ready or running), 0 while it loads "
                      "or failed.", "# TYPE paradiff_replica_up gauge"]
            lines += [f'paradiff_replica_up{{replica="{r}"}} {1 if state in ("ready", "busy") else 0}'
                      for r, state in sorted((replicas or {}).items())]
            lines += ["# HELP paradiff_replica_requests_running Requests each replica runs.",
                      "# TYPE paradiff_replica_requests_running gauge"]
            lines += [f'paradiff_replica_requests_running{{replica="{r}"}} {count}'
                      for r, count in sorted((replica_running or {}).items())]
            lines += ["# HELP paradiff_replica_steps_total Denoising steps each replica ran (cancelled requests' too).",
                      "# TYPE paradiff_replica_steps_total counter"]
            lines += [f'paradiff_replica_steps_total{{replica="{r}"}} {v}'
                      for r, v in sorted(self.replica_step_count.items())]
            lines += ["# HELP paradiff_replica_step_seconds_total Seconds each replica spent in denoising steps.",
                      "# TYPE paradiff_replica_step_seconds_total counter"]
            lines += [f'paradiff_replica_step_seconds_total{{replica="{r}"}} {v:.6f}'
                      for r, v in sorted(self.replica_step_seconds.items())]
            lines += ["# HELP paradiff_replica_steps_per_second Each replica's latest denoising rate (live during a "
                      "call, then its last round's).", "# TYPE paradiff_replica_steps_per_second gauge"]
            lines += [f'paradiff_replica_steps_per_second{{replica="{r}"}} {v:.6f}'
                      for r, v in sorted(self.replica_steps_per_s.items())]
            lines += ["# HELP paradiff_job_store_up 1 while the video jobs' store answers (0: a database server away).",
                      "# TYPE paradiff_job_store_up gauge", f"paradiff_job_store_up {int(job_store[0])}",
                      "# HELP paradiff_job_results_waiting Finished video jobs whose results wait for the store.",
                      "# TYPE paradiff_job_results_waiting gauge", f"paradiff_job_results_waiting {job_store[1]}"]
            lines += ["# HELP paradiff_up 1 while the server is ready.", "# TYPE paradiff_up gauge",
                      f"paradiff_up {1 if health in ('ready', 'degraded') else 0}"]
            return "\n".join(lines) + "\n"
