"""graphrunner-written equivalents of vLLM's offline examples (README "vLLM compatibility"), run in-process on the
demo model, asserting what the examples only print. The verbatim scripts and the `vllm` alias are tested in
test_vllm_examples.py, whose prompts (the examples' own) these reuse.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_vllm_examples import DEMO, PROMPTS  # tests/ is on sys.path

from graphrunner import LLM, EngineArgs, LLMEngine, SamplingParams, TokensPrompt
from graphrunner.argparse_utils import FlexibleArgumentParser
from graphrunner.distributed import cleanup_dist_env_and_memory
from graphrunner.engine_args import DEMO_MODEL_DIR
from graphrunner.metrics import Counter, Gauge, Histogram, Metric, Vector
from graphrunner.outputs import Logprob, RequestOutput
from graphrunner.profiler import ProfilerConfig


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_profile")


@pytest.fixture(scope="module")
def llm(profile_dir: Path) -> LLM:
    return LLM(max_model_len=512, profiler_config={"profiler": "torch", "torch_profiler_dir": str(profile_dir)})


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _texts(outputs: list[RequestOutput]) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_basic_equivalent(llm: LLM) -> None:
    """basic.py: a list of str prompts, one RequestOutput each, in order, with prompt and text."""
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == PROMPTS
    for out, prompt in zip(outputs, PROMPTS):
        assert out.finished and len(out.outputs) == 1
        comp = out.outputs[0]
        assert out.prompt_token_ids == tok.encode(prompt)
        assert 1 <= len(comp.token_ids) <= 8 and comp.finish_reason in ("length", "stop")
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)


def test_generate_equivalent(llm: LLM) -> None:
    """generate.py: EngineArgs flags + the example's own sampling flags on one FlexibleArgumentParser; every engine
    flag goes back into LLM(**args); the sampling flags are attribute writes on get_default_sampling_params()."""
    parser = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    parser.set_defaults(model=DEMO)
    group = parser.add_argument_group("Sampling parameters")
    for flag, kind in (("--max-tokens", int), ("--temperature", float), ("--top-p", float), ("--top-k", int)):
        group.add_argument(flag, type=kind)  # no clash with an engine flag
    args = vars(parser.parse_args(["--max_model_len", "512", "--max-tokens", "8", "--temperature", "0"]))
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    assert args.pop("top_p") is None and args.pop("top_k") is None
    config = EngineArgs(**args).create_engine_config()  # what LLM(**args) resolves (the shared llm is the same)
    assert config.scheduler.max_model_len == llm.config.scheduler.max_model_len == 512
    assert config.model_dir == llm.config.model_dir
    sp = llm.get_default_sampling_params()
    sp.max_tokens, sp.temperature = max_tokens, temperature
    outputs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) <= 8 for o in outputs)
    # temperature 0 is greedy: the same tokens again, and the same as each prompt alone (batching changes nothing)
    assert _texts(llm.generate(PROMPTS, sp, use_tqdm=False)) == _texts(outputs)
    assert [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == \
        [o.outputs[0].token_ids for o in outputs]


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


def test_chat_equivalent(llm: LLM, tmp_path: Path) -> None:
    """chat.py: one conversation -> 1 output, a list of conversations -> one each; the prompt is the tokenizer's
    chat template with the generation prompt; chat_template= (template text) replaces it."""
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    ids = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
    single = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(single) == 1
    assert single[0].prompt_token_ids == ids
    expected = llm.generate(TokensPrompt(prompt_token_ids=ids), GREEDY, use_tqdm=False)[0]
    assert single[0].outputs[0].token_ids == expected.outputs[0].token_ids
    batch = llm.chat([CONVERSATION] * 3, GREEDY, use_tqdm=False)
    assert len(batch) == 3 and {tuple(o.outputs[0].token_ids) for o in batch} == {tuple(expected.outputs[0].token_ids)}
    template_path = tmp_path / "template.jinja"  # chat.py --chat-template-path: the file's TEXT is passed
    template_path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    custom = llm.chat([CONVERSATION], GREEDY, use_tqdm=False, chat_template=template_path.read_text())
    text = "".join(f"{m['role']}: {m['content']}\n" for m in CONVERSATION) + "assistant:"
    assert custom[0].prompt_token_ids == tok.encode(text, add_special_tokens=False)


def test_reproducibility_equivalent() -> None:
    """reproducibility.py: the same seed gives the same sampled text in two engines, and building an LLM seeds the
    caller's `random` (so random.randint right after it repeats)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    drawn, texts = [], []
    for _ in range(2):
        random.seed(12345)  # whatever the caller's state was before, the engine reseeds it
        one = LLM(seed=7, max_model_len=256)
        drawn.append(random.randint(0, 100))
        texts.append(_texts(one.generate(PROMPTS, params, use_tqdm=False)))
        del one
        cleanup_dist_env_and_memory()
    assert drawn[0] == drawn[1] == random.Random(7).randint(0, 100)
    assert texts[0] == texts[1]


def test_llm_engine_equivalent() -> None:
    """llm_engine_example.py: requests added while others run, step() until done; n=2, logprobs, prompt_logprobs,
    penalties and top_k; each request reports exactly one finished output."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(description="LLMEngine"))
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "512"])))
    requests = [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1,
                                                                max_tokens=8)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1,
                                                        max_tokens=8)),
    ]
    finished: dict[str, RequestOutput] = {}
    request_id = 0
    while requests or engine.has_unfinished_requests():
        if requests:
            prompt, params = requests.pop(0)
            engine.add_request(str(request_id), prompt, params)
            request_id += 1
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    assert sorted(finished) == ["0", "1", "2"]
    first = finished["0"]
    plp = first.prompt_logprobs
    assert plp is not None and len(plp) == len(first.prompt_token_ids) and plp[0] is None
    for token, entry in zip(first.prompt_token_ids[1:], plp[1:]):
        assert token in entry and all(isinstance(v, Logprob) for v in entry.values()) and len(entry) <= 2
    comp = first.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert isinstance(entry[token], Logprob) and entry[token].rank == 1  # greedy: the sampled token is the top one
        assert entry[token].decoded_token == engine.get_tokenizer().decode([token])
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)),
                                                    abs=1e-4)
    assert finished["1"].prompt_logprobs is None and finished["1"].outputs[0].logprobs is None
    assert [c.index for c in finished["2"].outputs] == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for o in finished.values() for c in o.outputs)
    assert "RequestOutput(request_id='2'" in repr(finished["2"])  # the example prints it


def _by_name(metrics: list[Metric]) -> dict[str, list[Metric]]:
    out: dict[str, list[Metric]] = {}
    for m in metrics:
        out.setdefault(m.name, []).append(m)
    return out


def _counter(metrics: list[Metric], name: str) -> int:
    found = _by_name(metrics)[name]
    assert all(isinstance(m, Counter) for m in found)
    return sum(m.value for m in found)


def test_metrics_equivalent(llm: LLM) -> None:
    """metrics.py: get_metrics() returns vllm.v1.metrics.reader records whose counters and histograms add up to what
    the requests did (stats are always on; disable_log_stats=False is accepted)."""
    before = llm.get_metrics()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8), use_tqdm=False)
    after = llm.get_metrics()
    assert all(isinstance(m, (Counter, Gauge, Histogram, Vector)) and m.name.startswith("vllm:") for m in after)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert _counter(after, "vllm:prompt_tokens") - _counter(before, "vllm:prompt_tokens") == prompt
    assert _counter(after, "vllm:generation_tokens") - _counter(before, "vllm:generation_tokens") == generated
    assert _counter(after, "vllm:request_success") - _counter(before, "vllm:request_success") == len(PROMPTS)

    def hist(metrics: list[Metric], name: str) -> Histogram:
        (h,) = _by_name(metrics)[name]
        assert isinstance(h, Histogram) and h.buckets["+Inf"] == h.count
        return h

    ttft_after, ttft_before = hist(after, "vllm:time_to_first_token_seconds"), hist(before,
                                                                                    "vllm:time_to_first_token_seconds")
    assert ttft_after.count - ttft_before.count == len(PROMPTS)
    assert ttft_after.sum > ttft_before.sum
    gen = hist(after, "vllm:request_generation_tokens").sum - hist(before, "vllm:request_generation_tokens").sum
    assert gen == generated
    gauges = {m.name: m.value for m in after if isinstance(m, Gauge)}
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:num_requests_waiting"] == 0


def test_default_sampling_equivalent(llm: LLM) -> None:
    """basic_with_model_default_sampling.py: get_default_sampling_params() carries generation_config.json's
    temperature / top_p, is a new object per call, and generate() uses exactly those settings."""
    gen_cfg = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p) == (gen_cfg["temperature"], gen_cfg["top_p"])
    sp.temperature = 0.5
    assert llm.get_default_sampling_params().temperature == gen_cfg["temperature"]  # the write did not leak
    seeded = llm.get_default_sampling_params()
    seeded.seed, seeded.max_tokens = 123, 8
    explicit = SamplingParams(temperature=gen_cfg["temperature"], top_p=gen_cfg["top_p"], seed=123, max_tokens=8)
    assert _texts(llm.generate(PROMPTS, seeded, use_tqdm=False)) == \
        _texts(llm.generate(PROMPTS, explicit, use_tqdm=False))


def test_profiling_equivalent(llm: LLM, profile_dir: Path) -> None:
    """simple_profiling.py: start_profile() .. generate .. stop_profile() writes a Chrome trace JSON into
    profiler_config's torch_profiler_dir."""
    before = set(profile_dir.glob("*.json"))
    llm.start_profile()
    outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4), use_tqdm=False)
    llm.stop_profile()
    assert len(outputs) == 2
    (trace,) = set(profile_dir.glob("*.json")) - before
    assert json.loads(trace.read_text())["traceEvents"]


def test_profiler_config_forms() -> None:
    """vllm.config.ProfilerConfig or a dict; what graphrunner cannot do is refused before any model loads."""
    assert ProfilerConfig.coerce({"profiler": "torch", "torch_profiler_dir": "/x"}) == \
        ProfilerConfig.coerce(ProfilerConfig(profiler="torch", torch_profiler_dir="/x"))
    with pytest.raises(ValueError, match="max_iterations"):
        ProfilerConfig.coerce(ProfilerConfig(profiler="torch", torch_profiler_dir="/x", max_iterations=1))
    with pytest.raises(ValueError, match="only the 'torch' profiler"):
        LLM(profiler_config={"profiler": "cuda"})
    with pytest.raises(ValueError, match="unsupported key"):
        LLM(profiler_config={"profiler": "torch", "torch_profiler_with_stack": True})


PREFIX = ("You are an expert school principal, skilled in effectively managing faculty and staff. Draft 10-15 "
          "questions for a potential first grade Head Teacher for my K-12, all-girls', independent school that "
          "emphasizes community, joyful discovery, and life-long learning. ")


def test_prefix_caching_equivalent(llm: LLM) -> None:
    """prefix_caching.py: greedy outputs are the same without and with enable_prefix_caching (accepted; the prefix
    cache itself is not built yet), a single str prompt gives a list of one, and a second LLM can be built after
    cleanup_dist_env_and_memory()."""
    prompts = [PREFIX + p for p in PROMPTS]
    regular = _texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    cached_llm = LLM(max_model_len=512, enable_prefix_caching=True)
    try:
        assert cached_llm.config.enable_prefix_caching
        warm = cached_llm.generate(prompts[0], GREEDY, use_tqdm=False)
        assert len(warm) == 1 and warm[0].prompt == prompts[0]
        assert _texts(cached_llm.generate(prompts, GREEDY, use_tqdm=False)) == regular
        assert cached_llm.reset_prefix_cache() is True
    finally:
        del cached_llm
        cleanup_dist_env_and_memory()
