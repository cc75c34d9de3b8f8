"""`plait serve --model FILE.gguf`: the server's tokenizer and chat template come from the file, and a
greedy chat completion is the offline engine's on the Hugging Face checkpoint the file was written
from (the same weights)."""

from __future__ import annotations

from tests.server.conftest import MAIN_ENGINE_FLAGS, Server


def test_a_gguf_served_chat_completion_matches_the_offline_engine(server_model, offline_engine, tokenizer,
                                                                    tmp_path, monkeypatch):
    from plait.testing.gguf_writer import write_gguf

    (tmp_path / "gguf").mkdir()
    path = write_gguf(server_model, tmp_path / "gguf" / "model.gguf")
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))  # the converted tokenizer's cache
    srv = Server(path, tmp_path, "gguf", **MAIN_ENGINE_FLAGS)
    try:
        srv.wait_ready()
        messages = [{"role": "user", "content": "Once upon a time"}]
        reply = srv.openai().chat.completions.create(model=str(path), messages=messages, max_tokens=12,
                                                     temperature=0)
    finally:
        srv.stop()
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    expected = offline_engine.generate(prompt_ids, {"max_new_tokens": 12, "temperature": 0})
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == expected.text
