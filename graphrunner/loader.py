"""Load an HF safetensors checkpoint into a graphrunner model, strictly.

The model is built by whatever builds it (the architecture's ModelState, handed in by the front) on
the meta device (no double initialisation), materialised on the target device, then filled: HF names map 1:1 onto parameters except fused ones (the model's
`packed_modules`), whose shards are copied into their slices; a tensor-parallel layer (`tp_shard_of`) takes
only its rank's part of each checkpoint tensor. Missing or unexpected weights raise.
A broken file (corrupt shard index, truncated / empty / garbage safetensors) raises ValueError naming it;
every file's header is checked before the model is built.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_NAMES = 20  # names listed in an error message before "... and N more"


def _name_list(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f", ... and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def _read_index(index: Path) -> dict[str, str]:
    """The weight_map of a shard index, checked: a JSON object whose weight_map maps names to plain file names."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, absurdly nested
        raise ValueError(f"shard index {index} is not a readable JSON file: {exc}") from exc
    if not isinstance(data, dict):  # a broken file, not a caller's type error: ValueError like every file problem
        raise ValueError(f"shard index {index} must contain a JSON object, got {type(data).__name__}")
    weight_map = data.get("weight_map")
    if weight_map is None:
        return {}
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"shard index {index}: 'weight_map' must be a JSON object, got {type(weight_map).__name__}")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"shard index {index}: weight_map[{key!r}] must be a file name inside the model "
                             f"directory, got {name!r}")
    return weight_map


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: from the shard index, else model.safetensors,
    else every *.safetensors; ValueError naming the directory when there are none, or the index when it is broken."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shard files that do not exist: {_name_list(missing)}")
        if files:
            return files
    single = model_dir / _SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(f for f in model_dir.glob("*.safetensors") if f.is_file())
    if not files:
        raise ValueError(f"no safetensors weights (model.safetensors or sharded *.safetensors) in {str(model_dir)!r}")
    return files


def _unreadable(path: Path, exc: Exception) -> ValueError:
    return ValueError(f"could not read safetensors file {path}: {' '.join(str(exc).split())} "
                      f"(truncated or not a safetensors file?)")


def check_checkpoint(files: Iterable[Path]) -> None:
    """Open every file once (reads only its header): a truncated, empty or garbage file fails here, before
    the model is built, with a ValueError naming the file."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                f.keys()
        except Exception as exc:  # SafetensorError, OSError, ...: whatever the file is, name it
            raise _unreadable(path, exc) from exc


def iter_checkpoint(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the given safetensors files, one at a time; a file that cannot
    be read raises ValueError naming it."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError, OSError, ...
            raise _unreadable(path, exc) from exc
        with handle as f:
            try:
                keys = list(f.keys())
            except Exception as exc:
                raise _unreadable(path, exc) from exc
            for key in keys:
                try:
                    tensor = f.get_tensor(key)
                except Exception as exc:  # e.g. a dtype torch lacks, or data past the end of the file
                    raise ValueError(f"could not read tensor {key!r} from safetensors file {path}: {exc}") from exc
                yield key, tensor


def _is_ignored(key: str, tied: bool, shared: tuple[str, ...] = ()) -> bool:
    if key.endswith("rotary_emb.inv_freq") or key in shared:
        return True
    return tied and key == "lm_head.weight"


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model` (casting dtype, moving device); strict about names and shapes."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, ...]] = dict(getattr(model, "packed_modules", {}))
    shard_of = {shard: (fused, i) for fused, shards in packed.items() for i, shard in enumerate(shards)}
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # weights a model takes from another (an EAGLE head's embedding and LM head are the target's): not loaded
    shared: tuple[str, ...] = tuple(getattr(model, "shared_checkpoint_weights", ()))
    loaded: dict[str, set[int]] = {}  # param name -> loaded shard indices (-1 = the whole parameter)
    unexpected: list[str] = []
    for key, tensor in weights:
        if _is_ignored(key, tied, shared):
            continue
        parts = key.split(".")
        target, shard = key, -1
        if len(parts) >= 2 and parts[-2] in shard_of:
            fused, index = shard_of[parts[-2]]
            candidate = ".".join([*parts[:-2], fused, parts[-1]])
            if candidate in params:
                target, shard = candidate, index
        param = params.get(target)
        if param is None:
            unexpected.append(key)
            continue
        dst = param.data
        owner_name, _, leaf = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        if shard >= 0:
            shard_slice = getattr(owner, "shard_slice", None)
            if shard_slice is None:
                raise ValueError(f"fused parameter {target} (for {key}) has no shard_slice(); cannot place the shard")
            dst = dst[shard_slice(shard)]
        tp_shard_of = getattr(owner, "tp_shard_of", None)  # tensor-parallel layers keep only their rank's part
        if tp_shard_of is not None:
            tensor = tp_shard_of(leaf, shard, tensor)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)} for {target}")
        done = loaded.setdefault(target, set())
        if shard in done:
            raise ValueError(f"checkpoint tensor {key} appears more than once")
        dst.copy_(tensor)
        done.add(shard)
    if unexpected:
        raise ValueError(f"unexpected checkpoint weights (no matching parameter): {_name_list(unexpected)}")
    missing: list[str] = []
    for name in params:
        done = loaded.get(name, set())
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in packed:
            shards = packed[parts[-2]]
            missing += [".".join([*parts[:-2], shards[i], parts[-1]]) for i in range(len(shards)) if i not in done]
        elif -1 not in done:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {_name_list(missing)}")


class ModelBuilder(Protocol):
    """Builds the model without its weights (model_states.ModelState is one)."""

    def build_model(self, dtype: torch.dtype, device: torch.device | str) -> nn.Module: ...


def load_model(model_dir: Path, builder: ModelBuilder, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Build the model with `builder` (the architecture's ModelState) and load its weights; eval mode, no grads."""
    files = checkpoint_files(Path(model_dir))
    check_checkpoint(files)  # fail on a broken file before building (and allocating) the model
    model = builder.build_model(dtype, torch.device(device))
    load_weights(model, iter_checkpoint(files))
    return model
