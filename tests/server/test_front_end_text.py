"""Who turns tokens into text: by default the scheduler for every request; under
PLAIT_FRONTEND_DETOKENIZE=1 the HTTP process for requests without stop strings (the scheduler sends
their token ids only), the scheduler still for requests with stop strings (it ends them when one
appears). Either way a client reads the text the offline Engine gives."""

from __future__ import annotations

import pytest

from plait.engine.core import LiveRequest
from plait.engine.messages import front_end_detokenizes
from plait.sampling.params import SamplingParams
from tests.server.conftest import HTTP_TIMEOUT

FRONT_END = {"PLAIT_FRONTEND_DETOKENIZE": "1"}


@pytest.fixture(scope="module")
def front_end_server(start_server):
    """This module's own server, its HTTP process making the text (the shared one runs the default)."""
    return start_server("front-end-text", env=FRONT_END)


@pytest.fixture(scope="module")
def client(front_end_server):
    return front_end_server.openai()


@pytest.fixture(scope="module")
def model_name(front_end_server) -> str:
    return front_end_server.model


# Sampled at a high temperature: the tiny model's byte-level tokens then split characters across
# tokens, which the incremental detokenizer must hold back and complete exactly as the Engine's does.
WILD = {"temperature": 1.5, "top_p": 1.0, "max_tokens": 40}
PROMPTS = ["Hello", "The quick brown fox", "1, 2, 3,"]


def test_only_requests_without_stop_strings_are_detokenized_by_the_front_end():
    assert front_end_detokenizes(SamplingParams())
    assert front_end_detokenizes(SamplingParams(stop_token_ids=(5,)))
    assert not front_end_detokenizes(SamplingParams(stop=("\n",)))


def test_a_request_the_front_end_detokenizes_gets_updates_with_tokens_and_no_text(offline_engine):
    core = offline_engine.core
    req = core.new_request("front-end-text", [5, 6, 7], SamplingParams(max_new_tokens=8), seed=0, detokenize=False)
    assert req.detokenizer is None
    req.output_ids += [40, 41]
    update = LiveRequest(req).take_update()
    assert update is not None and update.token_ids == [40, 41] and update.text == ""


def test_a_request_with_stop_strings_must_be_detokenized_by_the_scheduler(offline_engine):
    with pytest.raises(ValueError, match="stop strings"):
        offline_engine.core.new_request("r", [5, 6], SamplingParams(stop=("x",)), seed=0, detokenize=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_made_by_the_front_end_equals_the_offline_engines(client, model_name, offline_engine, prompt):
    ref = offline_engine.generate(prompt, {"max_new_tokens": WILD["max_tokens"], "temperature": WILD["temperature"],
                                           "seed": 3})
    chunks = client.completions.create(model=model_name, prompt=prompt, stream=True, seed=3, timeout=HTTP_TIMEOUT,
                                       **WILD)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_whole_text_made_by_the_front_end_equals_the_offline_engines(client, model_name, offline_engine, prompt):
    ref = offline_engine.generate(prompt, {"max_new_tokens": WILD["max_tokens"], "temperature": WILD["temperature"],
                                           "seed": 4})
    out = client.completions.create(model=model_name, prompt=prompt, seed=4, timeout=HTTP_TIMEOUT, **WILD)
    assert out.choices[0].text == ref.text


def test_a_stop_string_still_ends_and_trims_the_text_as_the_engine_does(client, model_name, offline_engine):
    ref = offline_engine.generate("Hello", {"max_new_tokens": 40, "temperature": 1.5, "seed": 5})
    stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 2]
    assert stop.strip(), "the sampled text has no stop string to cut at"
    want = offline_engine.generate("Hello", {"max_new_tokens": 40, "temperature": 1.5, "seed": 5, "stop": [stop]})
    chunks = client.completions.create(model=model_name, prompt="Hello", stream=True, seed=5, stop=[stop],
                                       timeout=HTTP_TIMEOUT, **WILD)
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == want.text
    assert parts[-1].finish_reason == "stop"


def _client_run(model: str, params: dict[str, object]) -> tuple[list[str], str]:
    """A SchedulerClient over a real scheduler process, one streamed request: the texts of the updates as
    the scheduler sent them, and the text the client's caller reads."""
    import asyncio

    from plait.config import EngineConfig
    from plait.engine.messages import UpdateBatch
    from plait.server.metrics import ServerMetrics
    from plait.server.scheduler_client import SchedulerClient, State

    async def run() -> tuple[list[str], str]:
        client = SchedulerClient(EngineConfig(model=model, device="cpu", max_total_tokens=4096, context_length=512),
                                 ServerMetrics("m"), None)
        sent: list[str] = []
        dispatch = client._dispatch

        def observe(msg: object) -> None:  # the wire as received, before the client fills in text
            if isinstance(msg, UpdateBatch):
                sent.extend(u.text for u in msg.updates if u.token_ids)
            dispatch(msg)

        client._dispatch = observe  # type: ignore[method-assign]
        client.start()
        try:
            while client.state == State.STARTING:
                await asyncio.sleep(0.05)
            assert client.frontend is not None
            prepared = client.frontend.prepare("Hello", params)
            text = "".join([upd.text async for _, upd in client.generate([prepared])])
        finally:
            await client.shutdown()
        return sent, text

    return asyncio.run(run())


def test_by_default_the_scheduler_sends_the_text_of_every_request(server_model, offline_engine, monkeypatch):
    monkeypatch.delenv("PLAIT_FRONTEND_DETOKENIZE", raising=False)
    params = {"max_new_tokens": 12, "temperature": 1.5, "seed": 6}
    sent, text = _client_run(str(server_model), params)
    assert "".join(sent) == text == offline_engine.generate("Hello", params).text
    assert text


def test_the_scheduler_sends_no_text_for_a_request_the_front_end_detokenizes(server_model, offline_engine,
                                                                               monkeypatch):
    monkeypatch.setenv("PLAIT_FRONTEND_DETOKENIZE", "1")
    params = {"max_new_tokens": 12, "temperature": 1.5, "seed": 6}
    sent, text = _client_run(str(server_model), params)
    assert sent and all(t == "" for t in sent)
    assert text == offline_engine.generate("Hello", params).text


def test_the_scheduler_sends_the_text_of_a_request_with_stop_strings(server_model, offline_engine, monkeypatch):
    monkeypatch.setenv("PLAIT_FRONTEND_DETOKENIZE", "1")
    params = {"max_new_tokens": 12, "temperature": 1.5, "seed": 6, "stop": ["\u0000never"]}
    sent, text = _client_run(str(server_model), params)
    assert "".join(sent) == text == offline_engine.generate("Hello", params).text
    assert text
