"""vLLM's offline examples on graphrunner (README "vLLM compatibility").

Three parts:

1. the `vllm` -> graphrunner module alias (graphrunner.vllm_compat): every submodule path the examples import
   resolves to graphrunner's own module / class objects;
2. the verbatim vLLM 0.33 example scripts in tests/vllm_examples/ run through `python -m graphrunner.vllm_compat`
   on the demo model, with ONLY their hard-coded model names replaced by the demo model's directory (plus the
   command-line flags the scripts themselves offer: --max-tokens, --max-model-len, --model);
3. graphrunner-written equivalents of each example, run in-process, asserting what the examples only print.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import random
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from graphrunner import LLM, EngineArgs, LLMEngine, SamplingParams, TokensPrompt
from graphrunner.argparse_utils import FlexibleArgumentParser
from graphrunner.distributed import cleanup_dist_env_and_memory
from graphrunner.engine_args import DEMO_MODEL_DIR
from graphrunner.metrics import Counter, Gauge, Histogram, Metric, Vector
from graphrunner.outputs import Logprob, RequestOutput
from graphrunner.profiler import ProfilerConfig
from graphrunner.vllm_compat import install_vllm_alias, uninstall_vllm_alias

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = Path(__file__).resolve().parent / "vllm_examples"
DEMO = str(DEMO_MODEL_DIR)
# The hub ids the examples hard-code; the only text of a script the test changes.
MODEL_IDS = ("facebook/opt-125m", "meta-llama/Llama-3.2-1B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
             "lmsys/longchat-13b-16k")
PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
SCRIPT_TIMEOUT_S = 900


# --- 1. the module alias -------------------------------------------------------------------------------------

@pytest.fixture
def vllm_alias():
    install_vllm_alias()
    try:
        yield importlib.import_module("vllm")
    finally:
        uninstall_vllm_alias()


def test_alias_resolves_to_graphrunner_objects(vllm_alias: Any) -> None:
    import vllm  # the synthetic package the fixture installed
    import vllm.v1.metrics.reader  # a dotted import through two synthetic packages

    import graphrunner
    import graphrunner.argparse_utils
    import graphrunner.distributed
    import graphrunner.engine_args
    import graphrunner.inputs
    import graphrunner.llm
    import graphrunner.llm_engine
    import graphrunner.metrics
    import graphrunner.outputs
    import graphrunner.sampling_params

    for name in ("LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
                 "RequestOutputKind", "Logprob", "TextPrompt", "TokensPrompt"):
        assert getattr(vllm, name) is getattr(graphrunner, name), name
    assert sorted(vllm.__all__) == sorted(graphrunner.__all__)
    assert vllm.v1.metrics.reader is graphrunner.metrics
    from vllm.v1.metrics.reader import Counter as VCounter
    from vllm.v1.metrics.reader import Gauge as VGauge
    from vllm.v1.metrics.reader import Histogram as VHistogram
    from vllm.v1.metrics.reader import Vector as VVector

    assert (VCounter, VGauge, VHistogram, VVector) == (Counter, Gauge, Histogram, Vector)
    pairs = {"vllm.outputs": graphrunner.outputs, "vllm.sampling_params": graphrunner.sampling_params,
             "vllm.inputs": graphrunner.inputs, "vllm.utils.argparse_utils": graphrunner.argparse_utils,
             "vllm.engine.arg_utils": graphrunner.engine_args, "vllm.engine.llm_engine": graphrunner.llm_engine,
             "vllm.entrypoints.llm": graphrunner.llm}
    for alias, module in pairs.items():
        assert importlib.import_module(alias) is module, alias
        assert sys.modules[alias] is module
    assert vllm.outputs.RequestOutput is RequestOutput  # the parent gets the submodule as an attribute
    # vLLM <= 0.11 spelled it vllm.utils.FlexibleArgumentParser; 0.33 vllm.utils.argparse_utils
    from vllm.utils import FlexibleArgumentParser as Legacy
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Current

    assert Legacy is Current is FlexibleArgumentParser
    from vllm.distributed import cleanup_dist_env_and_memory as cleanup
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    assert cleanup is cleanup_dist_env_and_memory
    assert destroy_model_parallel is graphrunner.distributed.destroy_model_parallel
    assert destroy_distributed_environment is graphrunner.distributed.destroy_distributed_environment
    from vllm.config import ProfilerConfig as VProfilerConfig
    from vllm.logprobs import Logprob as VLogprob

    assert VProfilerConfig is ProfilerConfig and VLogprob is Logprob
    # the real module objects were not renamed or re-spec'd by the alias
    assert graphrunner.outputs.__name__ == "graphrunner.outputs"
    assert graphrunner.outputs.__spec__.name == "graphrunner.outputs"


def test_alias_refuses_what_it_does_not_have(vllm_alias: Any) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("vllm.model_executor")
    with pytest.raises(AttributeError, match="AsyncLLMEngine"):
        vllm_alias.AsyncLLMEngine  # noqa: B018
    with pytest.raises(ImportError):
        from vllm.utils import not_a_name  # noqa: F401
    install_vllm_alias()  # idempotent: still one hook
    from graphrunner import vllm_compat

    assert sum(isinstance(f, vllm_compat._VllmAliasFinder) for f in sys.meta_path) == 1


def test_uninstall_removes_the_alias() -> None:
    install_vllm_alias()
    import vllm.outputs  # noqa: F401

    uninstall_vllm_alias()
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    assert importlib.util.find_spec("vllm") is None  # no real vLLM in this environment, and no hook left


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "GRAPHRUNNER_DEVICE": "cpu"}


def _compat(args: list[str], cwd: Path, timeout: float = SCRIPT_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphrunner.vllm_compat", *args], cwd=cwd, env={**_env(), **env},
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_alias_is_lazy_and_the_runner_runs_a_script(tmp_path: Path) -> None:
    """Installing the alias and importing the light modules loads no engine; the runner sets __name__, sys.argv
    and sys.path like `python SCRIPT ARGS` and passes the script's exit status through."""
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "s.py").write_text(
        "import sys, json\n"
        "import vllm, vllm.v1.metrics.reader, vllm.utils, vllm.inputs\n"
        "from helper_mod import VALUE\n"
        "heavy = sorted(m for m in sys.modules if m in ('graphrunner.engine', 'graphrunner.llm', 'torch'))\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv[1:], 'heavy': heavy, 'value': VALUE,\n"
        "                  'reader': vllm.v1.metrics.reader.__name__}))\n"
        "sys.exit(3)\n")
    proc = _compat([str(tmp_path / "s.py"), "--x_y", "1"], cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "name": "__main__", "argv": ["--x_y", "1"], "heavy": [], "value": 7, "reader": "graphrunner.metrics"}
    usage = _compat([], cwd=ROOT, timeout=120)
    assert usage.returncode == 2 and "usage: python -m graphrunner.vllm_compat SCRIPT" in usage.stderr
    missing = _compat([str(tmp_path / "nope.py")], cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "no such script" in missing.stderr


# --- 2. the vLLM example scripts, verbatim but for the model path ----------------------------------------------

def _with_demo_model(name: str, tmp_path: Path) -> tuple[Path, int]:
    """tests/vllm_examples/NAME with each hard-coded model id replaced by the demo directory; (copy, replacements)."""
    text = (EXAMPLES / name).read_text()
    count = 0
    for model_id in MODEL_IDS:
        count += text.count(f'"{model_id}"')
        text = text.replace(f'"{model_id}"', json.dumps(DEMO))
    path = tmp_path / name
    path.write_text(text)
    return path, count


@dataclasses.dataclass
class Example:
    args: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()  # each must appear in stdout
    counts: tuple[tuple[str, int], ...] = ()  # (text, how many times it appears in stdout)
    hardcoded: bool = True  # the script names a model itself (else it comes from --model)


SMALL = ("--max-tokens", "8", "--max-model-len", "512")
SCRIPTS = {
    "basic.py": Example(markers=("Generated Outputs:",), counts=(("Output:    '", 4), ("Prompt:    '", 4))),
    "generate.py": Example(args=SMALL, counts=(("Generated text: '", 4),)),
    "chat.py": Example(args=SMALL, markers=("'role': 'system'",), counts=(("Generated text: '", 11),)),
    "llm_engine_example.py": Example(
        args=("--model", DEMO, "--max-model-len", "512"), hardcoded=False,
        markers=("prompt_logprobs=[None, {", "logprobs=[{", "CompletionOutput(index=1,"),
        counts=(("finished=True", 3), ("RequestOutput(request_id='", 3))),
    "metrics.py": Example(markers=("vllm:prompt_tokens (counter) = ", "vllm:generation_tokens (counter) = ",
                                   "vllm:num_requests_running (gauge) = 0.0",
                                   "vllm:time_to_first_token_seconds (histogram)\n    sum = ", "    +Inf = 4"),
                          counts=(("Generated text: '", 4),)),
    "basic_with_model_default_sampling.py": Example(counts=(("Generated text: '", 4),)),
    "prefix_caching.py": Example(markers=("Results without `enable_prefix_caching`",
                                          "Results with `enable_prefix_caching`",
                                          "Generated answers are the same: True")),
    "simple_profiling.py": Example(counts=(("Generated text: '", 4),)),  # sleeps 10 s at the end, as written
    "reproducibility.py": Example(counts=(("Generated text: '", 4),)),
    "automatic_prefix_caching.py": Example(counts=(("Output: ", 2), ("Generation time: ", 2))),
}


def test_every_saved_example_has_a_case() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS)
    for name in SCRIPTS:
        head = (EXAMPLES / name).read_text()
        if name != "basic_with_model_default_sampling.py":  # taken from vLLM 0.7.0, which had no header there
            assert head.startswith("# SPDX-License-Identifier: Apache-2.0\n"), name


def _apc_prompt_tokens() -> int:
    """Token count, with the demo tokenizer, of automatic_prefix_caching.py's shared LONG_PROMPT."""
    from transformers import AutoTokenizer

    install_vllm_alias()
    try:
        namespace = runpy.run_path(str(EXAMPLES / "automatic_prefix_caching.py"), run_name="apc")  # main() not run
    finally:
        uninstall_vllm_alias()
    tok = AutoTokenizer.from_pretrained(DEMO)
    return len(tok(namespace["LONG_PROMPT"])["input_ids"])


def _run_example(name: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    spec = SCRIPTS[name]
    script, replaced = _with_demo_model(name, tmp_path)
    assert (replaced > 0) == spec.hardcoded, f"{name}: {replaced} model ids replaced"
    proc = _compat([str(script), *spec.args], cwd=tmp_path, **env)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n" \
                                 f"stderr:\n{proc.stderr[-5000:]}"
    for marker in spec.markers:
        assert marker in proc.stdout, f"{name}: {marker!r} not in output:\n{proc.stdout[-3000:]}"
    for text, n in spec.counts:
        assert proc.stdout.count(text) == n, f"{name}: {text!r} x{proc.stdout.count(text)}, expected {n}"
    return proc


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n not in ("reproducibility.py", "simple_profiling.py",
                                                                  "automatic_prefix_caching.py")])
def test_vllm_example_runs_unchanged(name: str, tmp_path: Path) -> None:
    proc = _run_example(name, tmp_path)
    if name == "metrics.py":  # the prompt-token counter is exactly the four prompts' token counts
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(DEMO)
        assert f"vllm:prompt_tokens (counter) = {sum(len(tok.encode(p)) for p in PROMPTS)}\n" in proc.stdout


def test_vllm_simple_profiling_writes_a_trace(tmp_path: Path) -> None:
    _run_example("simple_profiling.py", tmp_path)
    traces = sorted((tmp_path / "vllm_profile").glob("*.json"))  # the script's ./vllm_profile, under its cwd
    assert len(traces) == 1, traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)


def test_vllm_reproducibility_example_repeats_across_processes(tmp_path: Path) -> None:
    runs = [_run_example("reproducibility.py", tmp_path, PYTHONHASHSEED=str(h)).stdout for h in (1, 2)]
    assert runs[0] == runs[1]
    # the engine seeded the script's own `random` with seed 0 (LLM's default), as vLLM does
    assert runs[0].strip().splitlines()[-1] == str(random.Random(0).randint(0, 100))


def test_vllm_automatic_prefix_caching_example(tmp_path: Path) -> None:
    n_tokens = _apc_prompt_tokens()
    context = json.loads((DEMO_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    if n_tokens + 100 > context:
        pytest.skip(f"automatic_prefix_caching.py: its LONG_PROMPT is {n_tokens} tokens with the demo tokenizer "
                    f"(+100 generated), over the demo model's {context}-token context; it runs as-is on a model "
                    f"whose context holds it (lmsys/longchat-13b-16k: 16K)")
    _run_example("automatic_prefix_caching.py", tmp_path)


# --- 3. graphrunner-written equivalents, in-process -------------------------------------------------------------

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
