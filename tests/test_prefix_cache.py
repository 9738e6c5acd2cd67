"""Prefix caching: the block pool's reference counts, LRU eviction and key map; SHA-256 chained block keys;
and whole engines whose greedy tokens with caching on equal HF's and caching off for shared prefixes of
0, block - 1, 1 block, several blocks and the whole prompt, through preemption, chunked prefill, n > 1,
seeds, prompt logprobs and salts, with `num_cached_tokens` and the metrics showing the hits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import hf_greedy, make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.kv_cache import BlockPool
from graphrunner.prefix_cache import extend_block_hashes, hash_block

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARCHS = ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]


# -- the pool and the keys -----------------------------------------------------------------------
def test_block_keys_chain_parent_tokens_and_salt() -> None:
    a, b = list(range(16)), list(range(16, 32))
    assert hash_block(None, a) == hash_block(None, list(a)) and len(hash_block(None, a)) == 32
    assert hash_block(None, a) != hash_block(None, b)
    assert hash_block(hash_block(None, a), b) != hash_block(hash_block(None, b), b)  # the parent matters
    assert hash_block(None, a, "x") != hash_block(None, a) != hash_block(None, a, "y")
    keys: list[bytes] = []
    extend_block_hashes(keys, a + b + [1, 2], 34, BS)
    assert keys == [hash_block(None, a), hash_block(hash_block(None, a), b)]  # the partial block has no key
    extend_block_hashes(keys, a + b + [1, 2], 34, BS)
    assert len(keys) == 2
    tail_only: list[bytes] = keys[:1]
    extend_block_hashes(tail_only, b + [1, 2], 34, BS, start=16)  # only the tokens the missing block needs
    assert tail_only == keys


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_bulk_block_keys_equal_the_chain_of_hash_block(salt: str | None) -> None:
    """extend_block_hashes packs a whole range at once: its keys equal hash_block chained block by block, for
    large ids, any start offset and resumed extension (a preempted request's keys grow later)."""
    rng = random.Random(3)
    ids = [rng.randrange(2**31) for _ in range(7 * BS + 5)] + [0, 151_935]
    chain: list[bytes] = []
    for i in range(len(ids) // BS):
        chain.append(hash_block(chain[-1] if chain else None, ids[i * BS:(i + 1) * BS], salt))
    for first in (0, 1, 3):
        keys = chain[:first]
        extend_block_hashes(keys, ids[first * BS:], len(ids) - 6, BS, salt, start=first * BS)  # stop early
        extend_block_hashes(keys, ids[first * BS:], len(ids), BS, salt, start=first * BS)
        assert keys == chain


def test_pool_reference_counts_lru_and_eviction() -> None:
    pool = BlockPool(7, enable_caching=True)  # blocks 1..6
    first = pool.allocate(3)
    assert first == [1, 2, 3] and pool.num_free == 3
    pool.register(1, b"k1")
    pool.register(2, b"k2")
    assert pool.lookup([b"k1", b"k2", b"k3"]) == [1, 2]
    pool.hold([1, 2])  # a second request shares the prefix
    assert pool.ref_count(1) == 2
    pool.free(first)  # the first owner ends: shared blocks stay held, block 3 is free
    assert pool.num_free == 4 and pool.ref_count(1) == 1 and pool.ref_count(3) == 0
    pool.free([1, 2])  # tail first: block 2 is evicted before block 1
    assert pool.lookup([b"k1", b"k2"]) == [1, 2]  # free blocks are still hits
    assert pool.reset_prefix_cache() is True and pool.lookup([b"k1"]) == []
    pool.register(1, b"k1")
    pool.register(2, b"k2")
    taken = pool.allocate(4)  # 4, 5, 6 were never used, then the queue's front: 3, then 2 (tail first)
    assert taken == [4, 5, 6, 3]
    assert pool.lookup([b"k1", b"k2"]) == [1, 2]
    assert pool.allocate(1) == [2] and pool.lookup([b"k1", b"k2"]) == [1]  # evicted: no longer a hit
    pool.hold([1])
    assert pool.reset_prefix_cache() is False  # a held block: nothing is dropped
    assert pool.allocate(1) is None


def test_pool_partial_blocks_are_hits_only_for_lookups_that_allow_them() -> None:
    """A block registered as partial (its proposer KV missing) is a hit for a plain lookup, ends a complete_only
    one, and gives its key up to a complete block registered later; a complete block keeps its key."""
    pool = BlockPool(8, enable_caching=True)
    a = pool.allocate(3)
    pool.register(a[0], b"k1")
    pool.register(a[1], b"k2", partial=True)
    pool.register(a[2], b"k3", partial=True)
    assert pool.lookup([b"k1", b"k2", b"k3"]) == a
    assert pool.lookup([b"k1", b"k2", b"k3"], complete_only=True) == a[:1]
    b = pool.allocate(2)
    pool.register(b[0], b"k2")  # recomputed with the proposer running: takes the key over
    pool.register(b[1], b"k1")  # k1's holder is complete: it keeps it
    pool.register(b[1], b"k3", partial=True)  # a partial block never displaces another
    assert pool.lookup([b"k1", b"k2", b"k3"], complete_only=True) == [a[0], b[0]]
    assert pool.lookup([b"k1", b"k2", b"k3"]) == [a[0], b[0], a[2]]
    pool.free(a)  # the free queue: 6, 7, then a tail first
    assert pool.allocate(2) == [6, 7] and pool.lookup([b"k1", b"k2", b"k3"]) == [a[0], b[0], a[2]]
    assert pool.allocate(1) == [a[2]]  # evicted: the partial hit is forgotten
    assert pool.lookup([b"k1", b"k2", b"k3"]) == [a[0], b[0]] and pool.num_cached == 2
    assert pool.allocate(1) == [a[1]]  # the displaced block came back as a plain free block
    assert pool.lookup([b"k1", b"k2"]) == [a[0], b[0]]


def test_pool_without_caching_registers_nothing() -> None:
    pool = BlockPool(4)
    block = pool.allocate(1)
    pool.register(block[0], b"k")
    assert pool.lookup([b"k"]) == [] and pool.num_cached == 0


# -- engines -----------------------------------------------------------------------------------
def _prompts(seed: int = 0) -> list[list[int]]:
    """A shared 70-token base; later prompts share 0, BS - 1, BS, 3 * BS and all of it (then more)."""
    rng = random.Random(seed)
    base = [rng.randrange(400) for _ in range(70)]
    prompts = [base[:n] + [rng.randrange(400) for _ in range(k)]
               for n, k in [(0, 20), (BS - 1, 5), (BS, 4), (3 * BS, 9), (70, 0), (70, 3)]]
    return [*prompts, list(prompts[4])]  # the whole prompt once more


@pytest.fixture(scope="module", params=ARCHS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("pc"), request.param)
    return model_dir, [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in _prompts()]


def _one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


def _assert_all_released(llm: LLM) -> None:
    pool = llm.engine.scheduler.pool
    assert pool.num_free == pool.num_usable
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def test_cached_prefixes_match_hf_and_caching_off(case: tuple[Path, list]) -> None:
    model_dir, expected = case
    off = LLM(model=model_dir, num_gpu_blocks_override=128, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in off.generate(_prompts(), GREEDY, use_tqdm=False)] == expected
    on = LLM(model=model_dir, num_gpu_blocks_override=128)
    outs = _one_by_one(on, _prompts())
    assert [o.outputs[0].token_ids for o in outs] == expected
    # 0 and BS - 1 shared tokens hit nothing; one block; three blocks; the 70-token base (4 full blocks, the
    # prompt's 5th block filled by the 6th request's generated tokens); the whole prompt keeps one token back
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, BS, 3 * BS, 4 * BS, 4 * BS]
    metrics = {m.name: m for m in on.get_metrics()}
    assert metrics["vllm:prefix_cache_hits"].value == sum(o.num_cached_tokens for o in outs)
    assert metrics["vllm:prefix_cache_queries"].value == sum(len(p) for p in _prompts())
    _assert_all_released(on)
    assert on.reset_prefix_cache() and on.engine.scheduler.pool.num_cached == 0
    assert _one_by_one(on, _prompts()[4:5])[0].num_cached_tokens == 0  # nothing cached after the reset


def test_whole_batch_shares_prefixes_in_one_step(case: tuple[Path, list]) -> None:
    """Requests admitted together hit blocks a request ahead of them in the same step computes."""
    model_dir, expected = case
    llm = LLM(model=model_dir, num_gpu_blocks_override=128)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) > 0
    _assert_all_released(llm)


def test_preemption_and_chunked_prefill_keep_hits(case: tuple[Path, list]) -> None:
    model_dir, _ = case
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # decodes that must grow
    expected = [hf_greedy(model_dir, p, long.max_tokens) for p in _prompts()]
    llm = LLM(model=model_dir, num_gpu_blocks_override=9, max_num_batched_tokens=24)  # 8 blocks: the longest needs 8
    _one_by_one(llm, _prompts()[4:5], long)  # warm the base prefix
    outs = llm.generate(_prompts(), long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    _assert_all_released(llm)


def test_n_seeds_logprobs_and_salt(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    prompt = _prompts()[4]
    sampled = SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=8, ignore_eos=True, logprobs=2)
    off = LLM(model=model_dir, num_gpu_blocks_override=64, enable_prefix_caching=False)
    on = LLM(model=model_dir, num_gpu_blocks_override=64)
    ref = off.generate([prompt], sampled, use_tqdm=False)[0]
    _one_by_one(on, [prompt])  # cache it
    got = on.generate([prompt], sampled, use_tqdm=False)[0]
    assert got.num_cached_tokens == 4 * BS
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]  # seeds are per position
    for a, b in zip(got.outputs, ref.outputs):
        assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
    plp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    with_plp = on.generate([prompt], plp, use_tqdm=False)[0]
    assert with_plp.num_cached_tokens == 0 and len(with_plp.prompt_logprobs) == len(prompt)  # computes it all
    ref_plp = off.generate([prompt], plp, use_tqdm=False)[0].prompt_logprobs
    assert [None if d is None else sorted(d) for d in with_plp.prompt_logprobs] == \
        [None if d is None else sorted(d) for d in ref_plp]
    salted = on.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0  # another salt: another cache
    again = on.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 4 * BS and again.outputs[0].token_ids == salted.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        on.generate([{"prompt_token_ids": prompt, "cache_salt": 5}], GREEDY, use_tqdm=False)
    _assert_all_released(on)


@pytest.mark.gpu
def test_prefix_cache_with_cuda_graphs(tmp_path: Path) -> None:
    """On the GPU with FULL and PIECEWISE graphs: shared prefixes hit, and tokens equal caching off."""
    from graphrunner.step_plan import StepMode

    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    prompts = _prompts() * 3
    kwargs = {"dtype": "float32", "max_model_len": 256, "device": "cuda"}
    off = LLM(model=model_dir, enable_prefix_caching=False, **kwargs)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    on = LLM(model=model_dir, **kwargs)
    first = on.generate(prompts, GREEDY, use_tqdm=False)
    second = on.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert all(o.num_cached_tokens >= BS for o in second if len(o.prompt_token_ids) > BS)
    assert on.engine.runner.graphs.mode_counts[StepMode.FULL] > 0
    _assert_all_released(on)


def test_token_arrays_give_the_keys_of_the_token_lists() -> None:
    """Request.token_array (int32, the prompt converted once) holds the token list's values for ranges inside the
    prompt, across its end, inside the outputs and empty; hashed, it gives the list's keys (a whole history, and
    the tail after the first block, as a resumed request hashes it)."""
    from graphrunner.request import Request

    rng = random.Random(11)
    prompt = [rng.randrange(151_936) for _ in range(5 * BS + 3)]
    req = Request("r", "r", 0, prompt, SamplingParams(), seed=0, max_tokens=40)
    req.output_token_ids = [rng.randrange(151_936) for _ in range(2 * BS + 1)]
    every = prompt + req.output_token_ids
    for start, end in ((0, len(prompt)), (BS, 3 * BS), (2 * BS, len(every)), (len(prompt) + 1, len(every)), (4, 4)):
        assert req.token_array(start, end).tolist() == every[start:end]
    want: list[bytes] = []
    extend_block_hashes(want, every, len(every), BS)
    got: list[bytes] = []
    extend_block_hashes(got, req.token_array(0, len(every)), len(every), BS)
    assert got == want and len(got) == len(every) // BS
    tail = got[:1]
    extend_block_hashes(tail, req.token_array(BS, len(every)), len(every), BS, start=BS)
    assert tail == want


def test_recent_keys_equal_hashing_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """RecentKeys (keys of recent prompts found again by comparing tokens) gives exactly extend_block_hashes' keys:
    prompts sharing 0 tokens, part of a block, 1 block, several blocks, a whole prompt, longer and shorter than the
    remembered one, under other salts, stopping early (num_tokens), after evictions; and it reuses what it can."""
    from array import array

    from graphrunner.prefix_cache import RecentKeys

    rng = random.Random(5)
    base = [rng.randrange(151_936) for _ in range(9 * BS + 7)]
    memo = RecentKeys(BS, capacity=3)
    cases = []
    for shared in (0, 5, BS, 3 * BS + 2, 7 * BS, len(base)):
        for extra in (0, 1, 2 * BS + 3):
            cases.append((base[:shared] + [rng.randrange(151_936) for _ in range(extra)], None))
    cases += [(base, "tenant-1"), (base[:4 * BS], "tenant-1"), (base, None), (base[:BS - 1], None)]
    rng.shuffle(cases)
    hashed = 0
    for tokens, salt in cases:
        for num_tokens in (len(tokens), len(tokens) - BS // 2):
            if num_tokens < 0:
                continue
            want: list[bytes] = []
            extend_block_hashes(want, tokens, num_tokens, BS, salt)
            got = memo.keys(array("i", tokens), num_tokens, salt)
            assert got == want, (len(tokens), num_tokens, salt)
            hashed += 1
    assert hashed > 30
    # a repeat of a remembered prompt re-hashes only its first block
    import graphrunner.prefix_cache as pc

    memo.keys(array("i", base), len(base), None)
    calls = []
    real = pc._hash_packed

    def counting(parent, packed, salt):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(parent, packed, salt)

    monkeypatch.setattr(pc, "_hash_packed", counting)
    again = memo.keys(array("i", base + [1, 2, 3]), len(base) + 3, None)
    assert len(calls) == 1 and len(again) == len(base + [1, 2, 3]) // BS
