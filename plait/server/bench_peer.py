"""The `serving-burst` workload's peer: the offline ``Engine`` on the server's own requests.

Same checkpoint, same engine options, same prompts and output lengths (greedy, ``ignore_eos``), all
added at once, as ``plait bench serve`` sends them to the server. The whole workload runs once
untimed (Triton compiles a kernel variant per launch shape class, as in ``offline-throughput``),
then once timed; time to first token is taken per request at the end of the step that produced its
first output token.
"""

from __future__ import annotations

import time
from typing import Any


def _burst(engine: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    reqs = [engine.make_request(prompt, {"max_new_tokens": olen, "temperature": 0.0, "ignore_eos": True})
            for prompt, olen in requests]
    first: list[float | None] = [None] * len(reqs)
    scheduler = engine.scheduler
    # The steps split as the server's scheduler loop splits them (``scheduler_loop_during``): a step
    # that starts with requests waiting or prefilling counts as a prefilling one.
    steps = [0, 0]  # decode-only, prefilling
    step_s = [0.0, 0.0]
    start = time.perf_counter()
    for req in reqs:
        scheduler.add_request(req)
    while any(not r.finished for r in reqs):
        prefills = bool(scheduler.waiting or scheduler.prefilling)
        t0 = time.perf_counter()
        scheduler.step()
        now = time.perf_counter()
        steps[prefills] += 1
        step_s[prefills] += now - t0
        for i, r in enumerate(reqs):
            if first[i] is None and r.output_ids:
                first[i] = now - start
    scheduler.flush()
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    loop = {"iterations": sum(steps), "prefill_iterations": steps[1],
            "step_ms_per_prefill_iteration": 1e3 * step_s[1] / steps[1] if steps[1] else None,
            "step_ms_per_decode_iteration": 1e3 * step_s[0] / steps[0] if steps[0] else None}
    ttfts = [t for t in first if t is not None]
    # As the server's ``timeline_ms``, every request "sent" at the start.
    timeline = {"last_sent": 0.0, "first_token": 1e3 * min(ttfts, default=0.0),
                "last_first_token": 1e3 * max(ttfts, default=0.0), "last_done": 1e3 * seconds}
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "generated_tokens": tokens,
            "ttft_s": ttfts, "loop": loop, "timeline_ms": timeline}


def offline_burst(model: str, engine_options: dict[str, Any], requests: list[tuple[list[int], int]],
                  idle_s: float = 0.0) -> dict[str, Any]:
    """The timed run's output tok/s and each request's TTFT (``ttft_s``, seconds), plus the untimed
    first pass's throughput. ``idle_s``: seconds the engine sits idle between the passes (the server
    meets its burst after the bench's set-up: whether an idle device starts slower)."""
    import gc

    from plait.config import EngineConfig
    from plait.engine import Engine
    from plait.engine.scheduler_process import leave_a_core_for_the_server
    from plait.engine.step_timing import step_timing

    # On the CPU, the model threads the server's scheduler process runs with (one core fewer).
    leave_a_core_for_the_server(EngineConfig.from_kwargs(model=model, **engine_options))
    engine = Engine(model=model, **engine_options)
    try:
        first_pass = _burst(engine, requests)
        engine.scheduler.tree_cache.reset()  # the timed run prefills every prompt again, as the server did
        time.sleep(idle_s)
        with step_timing(engine.scheduler) as steps:
            timed = _burst(engine, requests)
        # The steps by kind with the device's time per forward, as the server's ``scheduler_steps``.
        timed["steps"] = steps.summary(timed["seconds"])
        info = {"kv_capacity_tokens": engine.runner.max_total_tokens,
                "kv_tokens_in_use_after": engine.scheduler.kv_tokens_in_use()}
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    return {**timed, "first_pass_output_tok_s": first_pass["output_tok_s"], "idle_before_timed_s": idle_s, **info}
