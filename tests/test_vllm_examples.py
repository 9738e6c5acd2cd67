"""vLLM's offline examples on graphrunner (README "vLLM compatibility").

Two parts (the third, graphrunner-written equivalents asserting what the examples only print, is
test_vllm_equivalents.py):

1. the `vllm` -> graphrunner module alias (graphrunner.vllm_compat): every submodule path the examples import
   resolves to graphrunner's own module / class objects;
2. the verbatim vLLM 0.33 example scripts in tests/vllm_examples/ run through `python -m graphrunner.vllm_compat`
   on the demo model, with ONLY their hard-coded model names replaced by the demo model's directory (plus the
   command-line flags the scripts themselves offer: --max-tokens, --max-model-len, --model).
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

from graphrunner.argparse_utils import FlexibleArgumentParser
from graphrunner.distributed import cleanup_dist_env_and_memory
from graphrunner.engine_args import DEMO_MODEL_DIR
from graphrunner.metrics import Counter, Gauge, Histogram, Vector
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
