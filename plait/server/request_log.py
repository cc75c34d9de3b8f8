"""``--log-requests``: one log line per scheduler request when it ends.

Every line carries the request id, its status (the finish reason, or the error), prompt and output
tokens, the time to first token and the total latency. ``--log-requests-level`` adds more (SGLang's
levels): 1 the sampling parameters, 2 the first ``PARTIAL_CHARS`` characters of prompt and output, 3
all of them. Below level 2 no prompt or output text reaches the log.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from plait.sampling.params import SamplingParams

logger = logging.getLogger("plait.requests")

PARTIAL_CHARS = 2048


@dataclass
class RequestRecord:
    """What one request's log line reports, filled in while it runs."""

    rid: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    output_tokens: int = 0
    status: str = "aborted"  # until a finish reason or an error arrives: the client left
    output_text: list[str] = field(default_factory=list)


class RequestLog:
    def __init__(self, level: int, tokenizer: Any = None) -> None:
        self.level = level
        self.tokenizer = tokenizer  # set once loaded; decodes prompts at levels 2 and 3

    @property
    def keeps_text(self) -> bool:
        return self.level >= 2

    def write(self, rec: RequestRecord) -> None:
        now = time.perf_counter()
        ttft = f"{(rec.first_token - rec.arrival) * 1e3:.1f}" if rec.first_token is not None else "-"
        parts = [f"request {rec.rid}", f"status={rec.status}", f"prompt_tokens={len(rec.prompt_ids)}",
                 f"output_tokens={rec.output_tokens}", f"ttft_ms={ttft}",
                 f"latency_ms={(now - rec.arrival) * 1e3:.1f}"]
        if self.level >= 1:
            params = {k: v for k, v in dataclasses.asdict(rec.sampling_params).items() if k != "stop"}
            parts.append(f"sampling_params={params}")
        if self.level >= 2:
            limit = None if self.level >= 3 else PARTIAL_CHARS
            ids = rec.prompt_ids if limit is None else rec.prompt_ids[:limit]  # a token is >= 1 character
            prompt = self.tokenizer.decode(ids) if self.tokenizer is not None else str(ids)
            output = "".join(rec.output_text)
            parts.append(f"prompt={prompt[:limit]!r}")
            parts.append(f"output={output[:limit]!r}")
        logger.info(" ".join(parts))
