"""SGLang's and vLLM's launch flags: every alias parses to the same config as plait's own spelling;
token counts with suffixes; unknown flags name the closest flag; a checkpoint needing remote code is
refused naming its architecture. Parsing only: nothing is started."""

from __future__ import annotations

import json

import pytest

from plait.cli import build_parser, engine_options
from plait.cli_aliases import parse_token_count, unused_flag_warnings
from plait.config import EngineConfig
from plait.server.launch import server_args_from

# (SGLang / vLLM spelling, plait's spelling), each with a value.
ALIASES = [
    (["--model-path", "/m"], ["--model", "/m"]),
    (["--tokenizer-path", "/t"], ["--tokenizer", "/t"]),
    (["--tp-size", "2"], ["--tp", "2"]),
    (["--tensor-parallel-size", "2"], ["--tp", "2"]),
    (["--data-parallel-size", "2"], ["--dp-size", "2"]),
    (["--dp", "2"], ["--dp-size", "2"]),
    (["--gpu-memory-utilization", "0.5"], ["--mem-fraction-static", "0.5"]),
    (["--max-num-seqs", "7"], ["--max-running-requests", "7"]),
    (["--max-model-len", "4096"], ["--context-length", "4096"]),
    (["--context-length", "32k"], ["--context-length", "32000"]),
    (["--max-model-len", "32K"], ["--context-length", "32768"]),
    (["--dtype", "half"], ["--dtype", "float16"]),
    (["--dtype", "float"], ["--dtype", "float32"]),
    (["--trust-remote-code"], []),
    (["--enable-metrics"], []),
    (["--enable-cache-report"], []),
    (["--enable-mixed-chunk"], []),
    (["--grammar-backend", "xgrammar"], []),
    (["--page-size", "16"], []),
    (["--enable-torch-compile", "--torch-compile-max-bs", "8"], []),
    # vLLM's
    (["--enforce-eager"], ["--disable-cuda-graph"]),
    (["--no-enable-prefix-caching"], ["--disable-radix-cache"]),
    (["--enable-prefix-caching"], []),
    (["--max-num-batched-tokens", "4096"], ["--chunked-prefill-size", "4096"]),
    (["--no-enable-chunked-prefill"], ["--chunked-prefill-size", "-1"]),
    (["--enable-chunked-prefill"], []),
    (["--disable-log-stats"], ["--decode-log-interval", "0"]),
    (["--guided-decoding-backend", "none"], ["--grammar-backend", "none"]),
    (["--pipeline-parallel-size", "1"], []),
    (["--cpu-offload-gb", "0", "--tokenizer-mode", "auto", "--num-scheduler-steps", "1"], []),
    (["--seed", "7"], ["--random-seed", "7"]),
    (["--enable-expert-parallel", "--tp", "2"], ["--ep-size", "2", "--tp", "2"]),
    (["--block-size", "16", "--swap-space", "4", "--enable-reasoning", "--max-seq-len-to-capture", "8192",
      "--disable-frontend-multiprocessing", "--sampling-backend", "flashinfer", "--enable-p2p-check",
      "--show-time-cost"], []),
    (["--uvicorn-log-level", "warning"], ["--log-level-http", "warning"]),
    (["--tool-call-parser", "llama3_json"], ["--tool-call-parser", "llama3"]),
    (["--tool-call-parser", "openai"], ["--tool-call-parser", "gpt-oss"]),
    (["--reasoning-parser", "deepseek_r1"], ["--reasoning-parser", "deepseek-r1"]),
    (["--disable-log-requests"], []),
    (["--enable-auto-tool-choice"], []),
    (["--hf-overrides", '{"rope_theta": 5e5}'], ["--json-model-override-args", '{"rope_theta": 5e5}']),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
      '"prompt_lookup_max": 4}'],
     ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
      "--speculative-num-draft-tokens", "6", "--speculative-ngram-min-match-window-size", "2",
      "--speculative-ngram-max-match-window-size", "4"]),
    (["--speculative-config", '{"method": "eagle3", "model": "/draft", "num_speculative_tokens": 3}'],
     ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/draft", "--speculative-num-steps", "3",
      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]),
    (["--speculative-config", '{"model": "/draft"}'],
     ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/draft"]),
]


def parse_serve(argv: list[str]):
    args = build_parser().parse_args(["serve", *argv])
    model = args.model or "/default"
    return EngineConfig.from_kwargs(model=model, **engine_options(args)), server_args_from(args)


@pytest.mark.parametrize(("alias", "own"), ALIASES, ids=[a[0] for a, _ in ALIASES])
def test_every_alias_parses_to_the_config_of_plaits_own_spelling(alias, own):
    assert parse_serve(alias) == parse_serve(own)


def test_aliases_change_the_field_they_name():
    config, _ = parse_serve(["--model-path", "/m", "--tokenizer-path", "/t", "--tensor-parallel-size", "2",
                             "--max-model-len", "2k", "--dtype", "half", "--chunked-prefill-size", "-1"])
    assert (config.model, config.tokenizer, config.tp_size, config.context_length, config.dtype) == (
        "/m", "/t", 2, 2000, "float16")
    assert config.chunked_prefill_size == -1


def test_sglang_scheduling_and_server_process_flags_set_their_fields():
    config, sargs = parse_serve(["--schedule-policy", "lpm", "--max-prefill-tokens", "16384", "--cuda-graph-bs", "1",
                                 "2", "4", "--watchdog-timeout", "600", "--decode-log-interval", "10",
                                 "--grammar-backend", "none", "--log-level-http", "warning",
                                 "--disable-cuda-graph-padding", "--json-model-override-args", '{"rope_theta": 5e5}'])
    assert (config.schedule_policy, config.max_prefill_tokens, config.cuda_graph_bs) == ("lpm", 16384, (1, 2, 4))
    assert (config.watchdog_timeout, config.decode_log_interval, config.grammar_backend) == (600.0, 10, "none")
    assert sargs.log_level_http == "warning" and config.disable_cuda_graph_padding
    assert config.json_model_override_args == '{"rope_theta": 5e5}'


@pytest.mark.parametrize("flag", ["--schedule-policy=dfs-weight", "--grammar-backend=outlines",
                                  "--log-level-http=loud"])
def test_a_value_plait_does_not_have_fails_listing_the_choices(flag, capsys):
    with pytest.raises(SystemExit):
        parse_serve([flag])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--pipeline-parallel-size", "2"], "plait has no pipeline parallelism (split a model over GPUs with --tp-size): "
     "it must be 1"),
    (["--cpu-offload-gb", "4"], "plait keeps every weight on the device: it must be 0"),
    (["--tokenizer-mode", "slow"], "plait loads the fast (Rust) tokenizer: it must be auto"),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_a_flag_plait_takes_at_one_value_only_fails_at_another_saying_why(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_serve(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "extra", "message"), [
    ('{"method": "medusa"}', [], "method 'medusa' is not one plait runs"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 1}', [], r"unknown key\(s\) \['draft_tensor_parallel_size'\]"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', [], "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 3}', ["--speculative-num-steps", "2"],
     "--speculative-config and --speculative-num-steps both set it"),
], ids=["method", "key", "tokens", "both"])
def test_a_vllm_speculative_config_plait_cannot_run_fails_saying_why(spec, extra, message):
    with pytest.raises(ValueError, match=message):
        parse_serve(["--speculative-config", spec, *extra])


def test_sglang_kernel_flags_plait_does_not_use_are_accepted_with_a_warning_each():
    args = build_parser().parse_args(["serve", "--page-size", "16", "--enable-torch-compile"])
    warnings = unused_flag_warnings(args)
    assert [w.split()[0] for w in warnings] == ["--enable-torch-compile", "--page-size"]
    assert unused_flag_warnings(build_parser().parse_args(["serve"])) == []


def test_generate_takes_the_engine_aliases_too():
    args = build_parser().parse_args(["generate", "--model-path", "/m", "--max-model-len", "1K", "--prompt", "hi"])
    assert args.model == "/m" and engine_options(args)["context_length"] == 1024


@pytest.mark.parametrize(("raw", "tokens"), [("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("1m", 1_000_000),
                                             ("1M", 1_048_576), ("1.5k", 1500), ("2G", 2**31)])
def test_token_counts_read_suffixes_as_vllm_does(raw, tokens):
    assert parse_token_count(raw) == tokens


@pytest.mark.parametrize("raw", ["32q", "k", "1.5K", "1.0001k", "-5", "32 k k", ""])
def test_a_malformed_token_count_fails_naming_the_flag(raw, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--context-length", raw])
    err = capsys.readouterr().err
    assert "--context-length" in err and "32k = 32000" in err


def test_an_unknown_dtype_fails_listing_the_accepted_names(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert "--dtype" in err and "half" in err and "float32" in err


def test_chunked_prefill_size_minus_one_turns_chunking_off():
    config, _ = parse_serve(["--chunked-prefill-size", "-1"])
    assert config.prefill_token_budget(4096) == 4096  # the whole context: no prompt is split
    assert EngineConfig(model="/m", chunked_prefill_size=512).prefill_token_budget(4096) == 512
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(model="/m", chunked_prefill_size=0)


def test_an_engine_without_chunking_prefills_a_long_prompt_in_one_step(tiny_model_dir):
    import plait

    with plait.Engine(model=str(tiny_model_dir("llama")), device="cpu", chunked_prefill_size=-1,
                      max_total_tokens=1024, context_length=512) as engine:
        before = engine.core.scheduler.stats.forward_steps
        out = engine.generate(list(range(1, 301)), {"max_new_tokens": 1, "temperature": 0})
        assert out.meta_info["completion_tokens"] == 1
        assert engine.core.scheduler.stats.forward_steps - before == 1


TYPOS = [("--model-pth", "--model-path"), ("--max-model-length", "--max-model-len"), ("--api-keys", "--api-key"),
         ("--serve-model-name", "--served-model-name")]


@pytest.mark.parametrize(("typo", "closest"), TYPOS)
def test_an_unknown_flag_fails_at_parse_time_naming_the_closest_flag(typo, closest, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", typo, "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized argument {typo}" in err and f"the closest flag is {closest}" in err


def test_server_flags_reach_the_server_args():
    _, sargs = parse_serve(["--api-key", "k", "--allowed-origins", "https://a.example", '["https://b.example"]',
                            "--log-requests", "--log-requests-level", "2", "--sglang-metrics",
                            "--trust-request-chat-template"])
    assert sargs.api_key == "k"
    assert sargs.allowed_origins == ("https://a.example", "https://b.example")
    assert sargs.log_requests and sargs.log_requests_level == 2
    assert sargs.sglang_metrics and sargs.trust_request_chat_template
    _, default = parse_serve([])
    assert default.api_key is None and default.allowed_origins is None and not default.log_requests


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-queued-requests", "0"], ["--max-payload-bytes", "0"],
                                  ["--shutdown-timeout", "-1"], ["--max-stream-buffer", "0"]], ids=lambda a: a[0])
def test_a_server_flag_out_of_range_fails_naming_the_flag_and_its_limit(argv):
    with pytest.raises(ValueError, match=f"^{argv[0]} must be"):
        parse_serve(argv)


def test_https_needs_both_the_key_and_the_certificate_and_they_must_exist(tmp_path):
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile go together"):
        parse_serve(["--ssl-keyfile", str(tmp_path / "key.pem")])
    with pytest.raises(ValueError, match="--ssl-keyfile .*key.pem' is not a file"):
        parse_serve(["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem")])


def test_a_checkpoint_that_needs_remote_code_is_refused_naming_its_architecture(tiny_model_dir, tmp_path):
    import shutil

    ckpt = tmp_path / "custom"
    shutil.copytree(tiny_model_dir("llama"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(architectures=["MyCustomForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_my.MyModel"})
    (ckpt / "config.json").write_text(json.dumps(cfg))
    from plait.models.loader import load_model_config

    with pytest.raises(ValueError, match=r"MyCustomForCausalLM.*needs remote code.*plait runs no code"):
        load_model_config(str(ckpt))


def test_the_tokenizer_path_is_where_the_tokenizer_is_loaded_from(tiny_model_dir, tmp_path):
    import shutil

    import plait

    source = tiny_model_dir("llama")
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for f in source.iterdir():
        if "token" not in f.name and f.name != "special_tokens_map.json":
            shutil.copy(f, weights_only / f.name)
    with plait.Engine(model=str(weights_only), tokenizer=str(source), device="cpu", max_total_tokens=256) as engine:
        out = engine.generate("Hello there", {"max_new_tokens": 2, "temperature": 0})
    assert out.meta_info["completion_tokens"] == 2
