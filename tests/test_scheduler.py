"""Scheduler unit tests: token budget and chunked prefill, in-flight accounting (async outputs),
preemption by recompute of the newest request, and resources freed on finish.
"""

from __future__ import annotations

from graphrunner.config import SchedulerConfig
from graphrunner.kv_cache import BlockPool
from graphrunner.request import Request, RequestStatus
from graphrunner.sampling_params import SamplingParams
from graphrunner.scheduler import Scheduler


def _req(rid: str, prompt_len: int, max_tokens: int = 8, **kw: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return Request(rid, rid, 0, list(range(1, prompt_len + 1)), params, seed=0, max_tokens=max_tokens)


def _sched(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, 256), BlockPool(num_blocks), block_size)


def test_budget_chunks_prefill_and_samples_only_at_the_end() -> None:
    s = _sched(budget=10)
    r = _req("a", 23)
    s.add_request(r)
    chunks = []
    while True:
        out = s.schedule()
        (entry,) = out.scheduled
        chunks.append((entry.num_tokens, entry.samples))
        if entry.samples:
            break
    assert chunks == [(10, False), (10, False), (3, True)]
    assert r.num_inflight == 1 and r.num_computed_tokens == 23
    assert len(r.block_ids) == 6  # ceil(23 / 4)


def test_decode_is_scheduled_before_its_token_value_arrives() -> None:
    s = _sched()
    r = _req("a", 5, max_tokens=3)
    s.add_request(r)
    first = s.schedule()
    second = s.schedule()  # the host has not seen step 1's token, yet step 2 is scheduled
    assert second.scheduled[0].num_tokens == 1 and r.num_inflight == 2
    third = s.schedule()
    assert third.scheduled[0].num_tokens == 1 and r.num_inflight == 3
    assert not s.schedule(), "max_tokens tokens are in flight: nothing more is scheduled"
    for out, tok in ((first, 7), (second, 8), (third, 9)):
        s.update(out, [tok])
    assert r.output_token_ids == [7, 8, 9] and r.finish_reason == "length" and r.finished


def test_token_for_finished_request_is_dropped_and_resources_freed() -> None:
    s = _sched(num_blocks=16)
    r = _req("a", 4, max_tokens=10, stop_token_ids=[42])
    s.add_request(r)
    step1 = s.schedule()
    step2 = s.schedule()   # launched before step 1's output is read
    s.update(step1, [42])  # stop token: finished now
    assert r.finished and r.stop_reason == 42
    assert s.pool.num_free == 15 and s.rows.num_free == 8
    assert s.update(step2, [5]) == [] and r.output_token_ids == [42]


def test_preemption_recomputes_the_newest_request() -> None:
    s = _sched(num_blocks=6, budget=64, block_size=4)  # 5 usable blocks = 20 slots
    old, new = _req("old", 8, max_tokens=12), _req("new", 8, max_tokens=12)
    s.add_request(old)
    s.add_request(new)
    out = s.schedule()
    assert [e.request.request_id for e in out.scheduled] == ["old", "new"]  # 2 + 2 blocks
    s.update(out, [1, 1])
    # decodes grow: old needs a third block at token 9, and so does new -> only one fits
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_ids == []
    assert s.num_preemptions == 1
    s.update(out, [2])
    # new waits until blocks free up; its re-admission restages prompt + outputs (is_new)
    while not old.finished:
        out = s.schedule()
        s.update(out, [3] * len(out.scheduled))
    out = s.schedule()
    (entry,) = out.scheduled
    assert entry.request is new and entry.is_new and entry.num_tokens == 8 + 1


def test_waiting_request_with_inflight_token_is_not_readmitted_early() -> None:
    s = _sched(num_blocks=5, budget=64, block_size=4)  # 4 usable blocks
    a, b = _req("a", 7, max_tokens=8), _req("b", 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    out1 = s.schedule()
    assert len(out1.scheduled) == 2  # 2 blocks each
    out2 = s.schedule()  # both need a third block at token 9? no: 7 + 1 = 8 fits in 2 blocks
    out3 = s.schedule()  # token 9 needs a third block: b is preempted with tokens in flight
    assert out3.preempted == [b] and b.num_inflight == 2
    assert all(e.request is not b for e in out3.scheduled)
    s.update(out1, [1, 1])
    assert b.num_inflight == 1
    s.update(out2, [2, 2])
    assert b.output_token_ids == [1, 2] and b.num_inflight == 0


def test_draft_slots_stay_k_up_to_max_tokens_and_stop_at_max_model_len() -> None:
    """A decoding request keeps its k draft slots near max_tokens (a run that crosses it is cut there, so its
    verify steps stay uniform), and loses them only where the verified positions would pass max_model_len."""
    from graphrunner.spec_config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)

    def first_decode(max_tokens: int, max_model_len: int) -> tuple[Scheduler, Request, object, int]:
        s = Scheduler(SchedulerConfig(8, 32, max_model_len), BlockPool(64), 4, spec=spec)
        r = _req("a", 5, max_tokens=max_tokens)
        s.add_request(r)
        prefill = s.schedule()
        s.update(prefill, [7])
        out = s.schedule()
        return s, r, out, out.scheduled[0].num_spec

    s, r, out, num_spec = first_decode(max_tokens=3, max_model_len=64)
    assert num_spec == 3  # 2 tokens short of max_tokens, all 3 slots anyway
    s.update(out, [8], spec_tokens=[[8, 9, 10, 11]])  # every draft accepted, plus the bonus
    assert r.output_token_ids == [7, 8, 9] and r.finish_reason == "length"  # cut at max_tokens
    # the prompt (5) and the token out (1) leave 9 - 6 = 3 positions; 8 leave 2
    assert first_decode(max_tokens=3, max_model_len=9)[3] == 3
    assert first_decode(max_tokens=3, max_model_len=8)[3] == 2


def test_a_model_proposer_off_by_batch_size_ends_speculation_for_the_requests_in_that_step() -> None:
    """With a draft model and disable_by_batch_size 2: the requests that ran while speculation was off (the
    proposer did not run, so its KV has a gap) get no draft slots again, and the blocks they filled then are
    partial hits: a request admitted while the proposer runs recomputes them; one admitted while it is off shares
    them. A preemption recomputes a request, which then speculates again."""
    from graphrunner.spec_config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, disable_by_batch_size=2, model="d")
    s = Scheduler(SchedulerConfig(8, 64, 64), BlockPool(64, enable_caching=True), 4, spec=spec)
    a, b = _req("a", 9, max_tokens=20), _req("b", 5, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()  # nothing ran before: speculation on, both prefills observed
    assert out.spec_active and a.proposer_gap is None
    s.update(out, [100, 100])
    for t in range(101, 104):  # three steps with two running: off; a fills its third block (positions 8..11)
        out = s.schedule()
        assert not out.spec_active and [x.num_spec for x in out.scheduled] == [0, 0]
        s.update(out, [t, t])
    assert a.proposer_gap == 9 and b.proposer_gap == 5
    history = a.prompt_token_ids + a.output_token_ids  # 13 tokens: blocks 0, 1 complete, block 2 partial

    def sharing(rid: str) -> Request:
        r = _req(rid, 14, max_tokens=4)
        r.prompt_token_ids = history[:12] + [7, 7]
        s.add_request(r)
        return r

    e = sharing("e")
    out = s.schedule()  # still off: e takes the partial block (it will not speculate anyway)
    assert not out.spec_active and out.scheduled[-1].request is e and out.scheduled[-1].num_cached == 12
    assert e.proposer_gap == 0
    s.update(out, [104, 104, 104])
    s.finish(b, "abort")
    s.finish(e, "abort")
    c = sharing("c")
    out = s.schedule()  # one running: speculation on, yet a has none; c recomputes the partial block
    assert out.spec_active and out.scheduled[0].num_spec == 0
    assert out.scheduled[1].request is c and out.scheduled[1].num_cached == 8 and c.proposer_gap is None
    s.update(out, [105, 106])
    s._preempt(a, out)  # a recompute rebuilds its KV, the proposer's too, from the start
    assert a.proposer_gap is None
    out = s.schedule()  # c alone running: on; c speculates, a is readmitted with the proposer running
    assert out.spec_active and [(x.request, x.num_spec) for x in out.scheduled] == [(c, 2), (a, 0)]
    assert out.scheduled[1].is_new and a.proposer_gap is None
