"""The shipped demo model: it is the default model, HF transformers loads the same directory, and
HF's greedy continuation equals graphrunner's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from graphrunner import LLM, SamplingParams
from graphrunner.engine_args import DEMO_MODEL_DIR

PROMPTS = ["Once upon a time", "The king said unto", "It is a truth universally acknowledged"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # no model: the demo model


def test_default_model_is_the_demo(llm: LLM) -> None:
    assert llm.config.model_dir == DEMO_MODEL_DIR
    assert llm.config.model.architecture == "Qwen3ForCausalLM"
    size = sum(f.stat().st_size for f in DEMO_MODEL_DIR.iterdir())
    assert size <= 20 * 1024 * 1024


def test_hf_loads_demo_and_greedy_matches(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, ours):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_cli_generates_text_with_the_demo_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "graphrunner", "generate", "--max-tokens", "12", "Once upon a time"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("Once upon a time") and len(first) > len("Once upon a time")
    assert "finish_reason=" in proc.stdout
