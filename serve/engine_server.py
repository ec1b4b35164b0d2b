"""The engine deployment: one replica = one model instance (target + drafter + step loop).

Requests arrive as plain dicts from the ingress (already checked against the OpenAI schema);
the replica renders and tokenizes them, checks them against the context, and streams events:

    {"type": "start", "prompt_tokens": int, "seed": int | None, "prompt_token_ids": [int] (if asked)}
    {"type": "delta", "text": str, "tokens": [int]}          (zero or more: one a step at most)
    {"type": "end", "finish_reason": str, "usage": {...}}
or a single {"type": "error", "status": 4xx, "message": str, "param": str | None}.

Requests join the engine's Scheduler (workers.scheduler): its steps -- every running request
in one target forward -- run on one worker thread, fed from the event loop by `BatchDriver`, so
the loop stays free for health checks and new arrivals. A client that goes away cancels its
sequence, which leaves the batch at the next step and frees its memory. The distributed engine
(tp > 1) is driven the same way: its scheduler lives in the SchedulerActor (workers.distributed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import torch

from ..config import SamplingParams
from ..engine import Engine, freeze_startup
from ..kernels.sampling import draw_seed
from ..workers.requests import Request, Update
from ..workers.scheduler import QueueFull, Scheduler
from .config import ServeConfig
from .metrics import EngineMetrics

logger = logging.getLogger("ray.serve")

# A temperature below this is greedy decoding, as in vLLM (its _SAMPLING_EPS): the draw's limit.
GREEDY_BELOW_TEMPERATURE = 1e-5


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.status, self.param = status, param


class TextDeltas:
    """Turns the growing token list into text deltas that are final: it holds back text that
    could still become the start of a stop string, and an incomplete UTF-8 character."""

    def __init__(self, decode, stop: tuple[str, ...]):
        self.decode, self.sent = decode, 0
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def push(self, tokens: list[int]) -> str:
        text = self.decode(tokens)
        end = len(text) - self.holdback
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        return self._emit(text, end)

    def finish(self, final_text: str) -> str:
        return self._emit(final_text, len(final_text))

    def _emit(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta


class BatchDriver:
    """Feeds a Scheduler from asyncio. `stream` adds a request and yields its updates; the worker
    thread runs `scheduler.step()` back to back while there is work and hands each step's updates
    to the event loop, which puts each in its request's queue. `leave` ends a request's stream: a
    sequence that has not finished (its client left) is cancelled.

    The steps do not wait for the event loop: while it sends one step's updates on (a Ray stream
    item per request), the next step already runs. Were each step started from the loop, every
    step would begin only once the loop had sent the last one's items, and the engine would idle
    for that long each step, the longer the more streams it serves."""

    def __init__(self, scheduler: Scheduler, worker: ThreadPoolExecutor, on_step=None):
        self.scheduler, self.worker = scheduler, worker
        self.on_step = on_step  # called on the worker thread after every step, with the scheduler
        # the queues of the requests not yet finished, failed or left
        self.queues: dict[int, asyncio.Queue] = {}
        self.wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the steps' updates go to

    def submit(self, request: Request) -> int:
        """Queues a request; ValueError (it cannot run) or QueueFull (no room) at once."""
        if self.task is None or self.task.done():
            self.loop = asyncio.get_running_loop()  # before the request reaches the scheduler
            self.wake = asyncio.Event()
            self.task = self.loop.create_task(self._run())
        seq_id = self.scheduler.add(request)
        self.queues[seq_id] = asyncio.Queue()
        self.wake.set()
        return seq_id

    def updates(self, seq_id: int) -> AsyncIterator[list[Update]]:
        """The submitted request's updates, up to the one that carries its result, in batches:
        each batch is every update waiting when it is read (one step's, or several steps' when
        the reader fell behind), so a slow reader gets one event for them, not a backlog."""
        return self._drain(self.queues[seq_id])

    @staticmethod
    async def _drain(queue: asyncio.Queue) -> AsyncIterator[list[Update]]:
        while True:
            waiting = [await queue.get()]
            while not queue.empty():
                waiting.append(queue.get_nowait())
            # a failed step's error is the last thing a queue gets: the updates before it first
            batch = [u for u in waiting if not isinstance(u, BaseException)]
            if batch:
                yield batch
            if isinstance(waiting[-1], BaseException):
                raise waiting[-1]
            if batch[-1].result is not None:
                return

    def leave(self, seq_id: int) -> None:
        """The request's stream is over. Called whether or not its updates were ever read (a
        client can leave before the first one): a sequence not finished is cancelled."""
        if self.queues.pop(seq_id, None) is not None:
            self.scheduler.cancel(seq_id)
            self.wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                await loop.run_in_executor(self.worker, self._steps, loop)
            except Exception as err:  # a failed step fails every request in flight, not the replica
                logger.exception("ddtree engine step failed; ending the requests in flight")
                self.scheduler.abort_all()
                for queue in self.queues.values():
                    queue.put_nowait(err)
                self.queues.clear()

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the worker thread: steps while there is work, each step's updates handed to the
        driver's loop (in step order, before this call's own end or error reaches it). A run
        started for a loop that has since been replaced (each `asyncio.run` is a new loop) stops
        after its step in flight, whose updates go to the new loop: that step may have taken in
        a request submitted there, whose first tokens would be lost on the closed one. The new
        loop's own run steps on."""
        while self.scheduler.has_work and self.loop is loop:
            updates = self.scheduler.step()
            if self.on_step is not None:
                self.on_step(self.scheduler)
            try:
                self.loop.call_soon_threadsafe(self._deliver, updates)
            except RuntimeError:  # the loop closed and none replaced it: its streams are gone
                return

    def _deliver(self, updates: list[tuple[int, Update]]) -> None:
        for seq_id, update in updates:
            queue = self.queues.get(seq_id)
            if queue is not None:
                queue.put_nowait(update)
                if update.result is not None:
                    del self.queues[seq_id]


class EngineServer:
    def __init__(self, config: dict, replica: bool = False):
        """`replica`: this process holds this engine for its life (a Serve replica): what start-up
        built leaves the cycle collector's reach (`freeze_startup`)."""
        self.config = ServeConfig.model_validate(config)
        started = time.perf_counter()
        # Every forward of this engine -- start-up's calibration and warm-up too -- runs on this
        # one thread. OpenMP (libgomp) keeps a thread team per calling thread; a second team (the
        # constructor's) makes it count more threads than cores and stop spinning between
        # parallel regions, and each of a step's hundreds of regions then waits for a sleeping
        # worker to wake: the served step ran ~1.5x the in-process one on 2 cores.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtree-engine")
        self.engine = self.worker.submit(Engine.from_config, self.config).result()
        if replica:
            freeze_startup()
        self.created = int(time.time())
        self.metrics = EngineMetrics(self.config.served_name)
        graphs = self.engine.graph_stats  # None: no CUDA graphs
        self.metrics.set_kernels(self.engine.backends, graphs)
        # the graphs' eager steps before serving (start-up's calibration's), which the metric leaves out
        self._eager_at_start = graphs.eager_steps if graphs is not None else 0
        self.driver = BatchDriver(self.engine.scheduler, self.worker, self._step_metrics)
        logger.info(
            "ddtree engine ready: %s, budget %s, %d intra-op threads, linears %s, attention %s%s, %s, up to %d "
            "sequences at once, in %.1f s",
            self.config.served_name, self.engine.budget, torch.get_num_threads(), self.engine.backends.linear,
            self.engine.backends.attention,
            " (bitwise)" if self.engine.backends.bitwise else f" (fallback: {self.engine.backends.reason})",
            f"{graphs.captured} CUDA graphs" if graphs is not None else "no CUDA graphs",
            self.config.max_num_seqs, time.perf_counter() - started,
        )

    def batch_stats(self) -> dict:
        """The scheduler's batch (Scheduler.stats)."""
        return self.engine.scheduler.stats()

    def model_info(self) -> dict:
        return {
            "id": self.config.served_name,
            "created": self.created,
            "context_length": self.engine.context_length,
            "budget": self.engine.budget,
            # which backend runs the target's linears and attention (engine.check_kernels): /health says it
            "kernels": self.engine.backends.as_dict(),
            # the verify forwards captured as CUDA graphs (engine.graph_settings), None when none are
            "cuda_graphs": self.graph_info(),
        }

    def graph_info(self) -> dict | None:
        stats = self.engine.graph_stats
        if stats is None:
            return None
        return {"captured": stats.captured, "capture_seconds": round(stats.seconds, 3), "memory_bytes": stats.bytes,
                "left_out": [list(bucket) for bucket in stats.left_out], "eager_steps": stats.eager_steps}

    # --- request preparation ----------------------------------------------------------------

    def prepare(self, body: dict):
        """body: {"kind": "chat" | "completion", "messages" | "prompt", "max_tokens",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "budget", "lookup", "topk",
        "return_token_ids"} -> a Request."""
        if body["kind"] == "chat":
            try:
                prompt = self.engine.render_chat(body["messages"], body.get("chat_template_kwargs"))
            except ValueError as err:
                raise RequestError(str(err), "chat_template_kwargs") from None
            where = "messages"
        else:
            prompt = self.engine.encode(body["prompt"])
            where = "prompt"
        if not prompt:
            raise RequestError("the prompt is empty", where)
        cap = self.config.max_prompt_tokens
        if cap is not None and len(prompt) > cap:
            raise RequestError(f"the prompt has {len(prompt)} tokens; this server takes at most {cap}", where)
        context = self.engine.context_length
        room = context - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this model's context holds {context}", where
            )
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        elif max_tokens > room:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds this "
                f"model's context of {context} tokens", "max_tokens",
            )
        temperature = body.get("temperature")
        if temperature is not None and temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0  # logits / 1e-320 overflow to inf and the draw to NaN
        sampling = SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            top_k=body.get("top_k") or 0,
            min_p=body.get("min_p") or 0.0,
            seed=body.get("seed"),
        )
        sampling = sampling.model_copy(update={"seed": draw_seed(sampling)})  # the start event reports it
        budget = body.get("budget")
        if budget is not None:
            try:
                budget = self.engine.check_budget(budget, self.config.max_budget)
            except ValueError as err:
                raise RequestError(str(err), "speculation.budget") from None
        return self.engine.request(prompt, max_tokens, sampling, tuple(body.get("stop") or ()), budget,
                                   body.get("lookup"), body.get("topk"))

    # --- streaming ---------------------------------------------------------------------------

    def _step_metrics(self, scheduler: Scheduler) -> None:
        stats = scheduler.stats()
        self.metrics.set_batch(running=len(scheduler.running), queued=len(scheduler.waiting),
                               recalibrations=stats.get("recalibrations", 0))
        graphs = self.engine.graph_stats
        if graphs is not None:
            self.metrics.eager_steps(graphs.eager_steps - self._eager_at_start)

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        arrived = time.perf_counter()
        try:
            request = self.prepare(body)
        except RequestError as err:
            self.metrics.error(err.status)
            yield {"type": "error", "status": err.status, "message": str(err), "param": err.param}
            return
        try:
            seq_id = self.driver.submit(request)
        except QueueFull as err:
            self.metrics.error(429)
            yield {"type": "error", "status": 429, "message": f"the engine is at capacity ({err}); retry later",
                   "param": None}
            return
        except ValueError as err:
            self.metrics.error(400)
            yield {"type": "error", "status": 400, "message": str(err), "param": None}
            return
        updates = self.driver.updates(seq_id)  # its queue now: it may finish before the start is read
        tokens: list[int] = []
        unsent = 0  # the newest tokens not yet in a delta (stream_interval holds them)
        deltas = TextDeltas(self.engine.decode, request.stop)
        last, started, sent = arrived, False, False
        try:
            # queued: the client hears back now, before the first token
            start = {"type": "start", "prompt_tokens": len(request.prompt),
                     "seed": request.sampling.seed}  # None when greedy (draw_seed)
            if body.get("return_token_ids"):
                start["prompt_token_ids"] = list(request.prompt)
            yield start
            # One delta event for what a step emitted (a round's accepted tokens and its bonus),
            # or for several steps' when this stream's reader fell behind: one Ray stream item
            # and one SSE event per step at most, never one per token. After the first, a delta
            # waits until it holds `stream_interval` tokens (or the request ends).
            async for batch in updates:
                now = time.perf_counter()
                new_tokens = [t for update in batch for t in update.new_tokens]
                if not started:
                    started = True
                    self.metrics.first_token(now - arrived)
                elif new_tokens:
                    self.metrics.inter_token(now - last, len(new_tokens))
                last = now
                for update in batch:
                    if update.round is not None:
                        self.metrics.round(update.round)
                tokens.extend(new_tokens)
                unsent += len(new_tokens)
                self.metrics.output_tokens(len(new_tokens))
                result = batch[-1].result
                if result is None and sent and unsent < self.config.stream_interval:
                    continue
                text = deltas.finish(result.text or "") if result is not None else deltas.push(tokens)
                if text or unsent:
                    yield {"type": "delta", "text": text, "tokens": tokens[len(tokens) - unsent:]}
                    unsent, sent = 0, True
                if result is not None:
                    yield {"type": "end", "finish_reason": result.finish_reason,
                           "usage": self.usage(request, result)}
        finally:
            # also when the stream is closed at the start event, before the updates were read
            self.driver.leave(seq_id)

    def usage(self, request, result) -> dict:
        accepted = sum(r.accepted for r in result.rounds)
        drafted = sum(r.tree_size - 1 for r in result.rounds)
        budget = request.budget if request.budget is not None else self.engine.budget
        return {
            "prompt_tokens": len(request.prompt),
            "completion_tokens": len(result.tokens),
            "total_tokens": len(request.prompt) + len(result.tokens),
            "speculation": {
                "budget": budget,
                # what the batch granted: the largest budget a round of this request ran at
                "granted_budget": max((r.budget for r in result.rounds if r.budget is not None),
                                      key=lambda b: -1 if b == "chain" else b, default=budget),
                "rounds": len(result.rounds),
                "drafted_tokens": drafted,
                "accepted_tokens": accepted,
                # the accepted tokens by who proposed them: the drafter alone, the lookup branch
                # alone, both (the same token at the same place)
                "accepted_tokens_by_source": dict(zip(
                    ("drafter", "lookup", "both"),
                    (sum(r.accepted_sources[i] for r in result.rounds) for i in range(3)))),
                "lookup": request.lookup if request.lookup is not None else self.engine.config.lookup,
                "topk": request.topk if request.topk is not None else self.engine.config.topk,
                "tau": round(result.tau, 4),
            },
        }
