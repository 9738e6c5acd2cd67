"""Broken model directories give one clear ValueError naming the broken file, and loading never runs code.

A valid tiny Qwen3 is built once; each case copies it and breaks one file (config.json, the safetensors
weights, a shard index, the tokenizer files). Also: a hub id instead of a directory, the CLI's one-line
error (no traceback), an `auto_map` whose module must never be imported, and a good model still serving
after all the failures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, make_tiny_model

from graphrunner import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = [11, 22, 33, 44, 55]
Breaker = Callable[[Path], None]


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("good"), "Qwen3ForCausalLM")


def _write(name: str, content: str | bytes) -> Breaker:
    def breaker(model_dir: Path) -> None:
        path = model_dir / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return breaker


def _edit_json(name: str, edit: Callable[[dict[str, Any]], None]) -> Breaker:
    def breaker(model_dir: Path) -> None:
        data = json.loads((model_dir / name).read_text())
        edit(data)
        (model_dir / name).write_text(json.dumps(data))
    return breaker


def _set_config(**fields: Any) -> Breaker:
    return _edit_json("config.json", lambda cfg: cfg.update(fields))


def _drop_config(field: str) -> Breaker:
    return _edit_json("config.json", lambda cfg: cfg.pop(field))


def _truncate(name: str, fraction: float = 0.5, keep_bytes: int | None = None) -> Breaker:
    def breaker(model_dir: Path) -> None:
        data = (model_dir / name).read_bytes()
        (model_dir / name).write_bytes(data[: int(len(data) * fraction) if keep_bytes is None else keep_bytes])
    return breaker


def _shard(model_dir: Path) -> None:
    """Split model.safetensors into two shards plus a model.safetensors.index.json."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, model_dir / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _sharded_then(breaker: Breaker) -> Breaker:
    def both(model_dir: Path) -> None:
        _shard(model_dir)
        breaker(model_dir)
    return both


INDEX = "model.safetensors.index.json"
REQUIRED = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers",
            "architectures")

# (case id, breaker, substrings the error must contain: the broken file's name first)
CASES: list[tuple[str, Breaker, tuple[str, ...]]] = [
    ("config-corrupt", _write("config.json", '{"hidden_size": 64,'), ("config.json", "JSON")),
    ("config-empty", _write("config.json", ""), ("config.json",)),
    ("config-not-utf8", _write("config.json", b"\xff\xfe\x00{}"), ("config.json",)),
    ("config-list", _write("config.json", "[1, 2, 3]"), ("config.json", "JSON object")),
    ("config-number", _write("config.json", "42"), ("config.json", "JSON object")),
    *[(f"config-no-{f}", _drop_config(f), ("config.json", f)) for f in REQUIRED],
    ("config-str-size", _set_config(hidden_size="big"), ("config.json", "hidden_size", "big")),
    ("config-negative", _set_config(num_attention_heads=-4), ("config.json", "num_attention_heads")),
    ("config-float-layers", _set_config(num_hidden_layers=2.5), ("config.json", "num_hidden_layers")),
    ("config-bool-vocab", _set_config(vocab_size=True), ("config.json", "vocab_size")),
    ("config-arch-str", _set_config(architectures="Qwen3ForCausalLM"), ("config.json", "architectures")),
    ("config-rope-list", _set_config(rope_parameters=[1]), ("config.json", "rope_parameters")),
    ("config-rope-theta", _set_config(rope_parameters={"rope_theta": "x"}), ("config.json", "rope_theta")),
    ("config-eos-range", _set_config(eos_token_id=[0, 10**6]), ("config.json", "eos_token_id")),
    ("config-eps-str", _set_config(rms_norm_eps="1e-6"), ("config.json", "rms_norm_eps")),
    ("config-tie-str", _set_config(tie_word_embeddings="yes"), ("config.json", "tie_word_embeddings")),
    ("config-layer-types", _set_config(layer_types=["full_attention"]), ("config.json", "layer_types")),
    ("config-heads-ratio", _set_config(num_key_value_heads=3), ("config.json", "num_key_value_heads")),
    ("weights-truncated", _truncate("model.safetensors", 0.5), ("model.safetensors",)),
    ("weights-short-header", _truncate("model.safetensors", keep_bytes=5), ("model.safetensors",)),
    ("weights-empty", _write("model.safetensors", b""), ("model.safetensors",)),
    ("weights-garbage", _write("model.safetensors", bytes(range(256)) * 40), ("model.safetensors",)),
    ("weights-json-header", _write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"),
     ("model.safetensors",)),
    ("index-corrupt", _write(INDEX, '{"weight_map": {'), (INDEX,)),
    ("index-list", _write(INDEX, "[]"), (INDEX, "JSON object")),
    ("index-map-list", _write(INDEX, '{"weight_map": ["model.safetensors"]}'), (INDEX, "weight_map")),
    ("index-map-number", _write(INDEX, '{"weight_map": {"lm_head.weight": 3}}'), (INDEX, "lm_head.weight")),
    ("index-escapes-dir", _write(INDEX, '{"weight_map": {"x": "../model.safetensors"}}'), (INDEX, "../model")),
    ("index-missing-shard", _write(INDEX, '{"weight_map": {"x": "gone.safetensors"}}'), (INDEX, "gone.safetensors")),
    ("shard-truncated", _sharded_then(_truncate("model-00002-of-00002.safetensors", 0.3)),
     ("model-00002-of-00002.safetensors",)),
    ("shard-empty", _sharded_then(_write("model-00001-of-00002.safetensors", b"")),
     ("model-00001-of-00002.safetensors",)),
    ("tokenizer-corrupt", _write("tokenizer.json", '{"version": "1.0", "model": '), ("tokenizer.json", "tokenizer")),
    ("tokenizer-truncated", _truncate("tokenizer.json", 0.5), ("tokenizer.json", "tokenizer")),
    ("tokenizer-list", _write("tokenizer.json", "[1, 2]"), ("tokenizer.json", "tokenizer")),
    ("tokenizer-empty-object", _write("tokenizer.json", "{}"), ("tokenizer.json", "tokenizer")),
    ("tokenizer-config-corrupt", _write("tokenizer_config.json", "{bad"), ("tokenizer_config.json", "tokenizer")),
    ("tokenizer-config-list", _write("tokenizer_config.json", '["a"]'), ("tokenizer_config.json", "tokenizer")),
    ("tokenizer-config-binary", _write("tokenizer_config.json", b"\xff\xfe\x00garbage"),
     ("tokenizer_config.json", "tokenizer")),
]


def _broken_copy(good_dir: Path, dst: Path, breaker: Breaker) -> Path:
    shutil.copytree(good_dir, dst)
    breaker(dst)
    return dst


@pytest.mark.parametrize(("breaker", "expected"), [pytest.param(b, e, id=i) for i, b, e in CASES])
def test_broken_file_is_named(good_dir: Path, tmp_path: Path, breaker: Breaker, expected: tuple[str, ...]) -> None:
    broken = _broken_copy(good_dir, tmp_path / "broken", breaker)
    with pytest.raises(ValueError) as err:  # the message is checked below
        LLM(model=broken, num_gpu_blocks_override=16)
    message = str(err.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert str(broken) in message  # the file is named by its path, not just its base name


def test_corrupt_generation_config_is_named(good_dir: Path, tmp_path: Path) -> None:
    """generation_config.json gives the sampling defaults (generation_config="auto"): a corrupt one is named;
    with generation_config="vllm" it is not read at all."""
    broken = _broken_copy(good_dir, tmp_path / "gen", _write("generation_config.json", "{bad"))
    with pytest.raises(ValueError, match="generation_config.json"):
        LLM(model=broken, num_gpu_blocks_override=16)
    LLM(model=broken, num_gpu_blocks_override=16, generation_config="vllm")


def test_hub_id_is_not_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no local Qwen/ directory here
    expected = ("model 'Qwen/Qwen3-0.6B' is not a local directory; graphrunner downloads nothing: pass a local "
                "directory (e.g. one made by huggingface-cli download)")
    with pytest.raises(ValueError) as err:  # compared exactly below
        LLM(model="Qwen/Qwen3-0.6B")
    assert str(err.value) == expected
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(model=tmp_path / "missing" / "model")
    with pytest.raises(ValueError, match="model must be a local directory path"):
        LLM(model="")


def test_missing_tokenizer_dir_is_named(good_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer path .*nowhere.* is not a directory"):
        LLM(model=good_dir, tokenizer=tmp_path / "nowhere", num_gpu_blocks_override=16)


def test_no_tokenizer_files_gives_no_tokenizer(good_dir: Path, tmp_path: Path) -> None:
    bare = _broken_copy(good_dir, tmp_path / "bare", lambda d: [(d / n).unlink() for n in
                                                                 ("tokenizer.json", "tokenizer_config.json")])
    llm = LLM(model=bare, num_gpu_blocks_override=16)
    assert llm.get_tokenizer() is None
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("case", ["weights-truncated", "tokenizer-corrupt", "config-corrupt"])
def test_cli_prints_one_line_error(good_dir: Path, tmp_path: Path, case: str) -> None:
    breaker = next(b for i, b, _ in CASES if i == case)
    broken = _broken_copy(good_dir, tmp_path / "broken", breaker)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GRAPHRUNNER_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "graphrunner", "generate", "--model", str(broken), "hi"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphrunner: error:"), proc.stderr
    assert str(broken) in lines[0] and proc.stdout == ""


_EVIL = """\
from pathlib import Path
Path({marker!r}).write_text("custom code ran")
class EvilConfig: pass
class EvilModel: pass
class EvilTokenizer: pass
"""


def test_auto_map_code_is_never_run(good_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    model_dir = _broken_copy(good_dir, tmp_path / "custom", _write("evil.py", _EVIL.format(marker=str(marker))))
    _edit_json("config.json", lambda cfg: cfg.update(auto_map={
        "AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel", "AutoModelForCausalLM": "evil.EvilModel",
        "AutoTokenizer": ["evil.EvilTokenizer", None]}))(model_dir)
    _edit_json("tokenizer_config.json", lambda cfg: cfg.update(auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}))(
        model_dir)
    llm = LLM(model=model_dir, num_gpu_blocks_override=16)  # the architecture comes from our registry
    out = llm.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert not marker.exists() and not (model_dir / "__pycache__").exists()
    subprocess.run([sys.executable, str(model_dir / "evil.py")], check=True, timeout=60)
    assert marker.exists()  # the probe works: had the module been imported, the marker would be there


def test_good_model_still_generates_after_failures(good_dir: Path) -> None:
    """Runs last: none of the failures above left global state behind."""
    llm = LLM(model=good_dir, num_gpu_blocks_override=16)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(good_dir, PROMPT, 4)
