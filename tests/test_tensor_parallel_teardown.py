"""Leaving a tensor-parallel group without a hang: the CUDA graphs are dropped before the group is left (NCCL
cannot free a communicator that a live graph holds), leaving is bounded in time, and a step whose output never
arrives (a collective in a graph that no watchdog times out) ends with an error and the workers' stacks. CPU."""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import signal
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from capture.cuda_piece import GraphPiece, _Captured
from capture.manager import CaptureManager
from graphrunner import parallel_state, tp_workers
from graphrunner.config import ModelConfig
from graphrunner.input_prep import StepBuffers
from graphrunner.runner import ModelRunner
from model_states.llama import LlamaModelState

_CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=8, num_kv_heads=8, head_dim=4)


class _Graph:
    """Stands for a torch.cuda.CUDAGraph: only its lifetime matters here."""


def test_release_graphs_drops_every_full_and_piece_graph() -> None:
    piece = GraphPiece(lambda *a: a, "submod_0")
    manager = CaptureManager(LlamaModelState(_CFG), StepBuffers(4, 8, 4, torch.device("cpu")), [piece], [1, 2],
                             [1, 2, 4], max_model_len=64)
    full, pieced = _Graph(), _Graph()
    manager._full[(2, 2, 1, False)] = (full, ())
    piece.graphs[4] = _Captured(pieced, (), None)
    refs = [weakref.ref(full), weakref.ref(pieced)]
    del full, pieced
    runner = SimpleNamespace(graphs=manager)
    ModelRunner.release_graphs(runner)  # type: ignore[arg-type]
    gc.collect()
    assert runner.graphs is None and manager.num_graphs == 0
    assert [r() for r in refs] == [None, None]  # nothing keeps a graph (and so the communicator) alive
    ModelRunner.release_graphs(runner)  # type: ignore[arg-type]  # twice is harmless


def test_leaving_a_group_that_blocks_returns_within_the_bound(monkeypatch: pytest.MonkeyPatch,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))  # e.g. a graph holding NCCL
    start = time.monotonic()
    try:
        assert parallel_state.destroy_tensor_parallel(timeout_s=0.3) is False
        assert time.monotonic() - start < 5
        assert "did not finish within 0.3 s" in capfd.readouterr().err
        assert parallel_state.tp_size() == 1  # this process is no longer a rank, whatever NCCL does
    finally:
        release.set()
    assert parallel_state.destroy_tensor_parallel(timeout_s=5) is True  # once the stuck one ended, leaving works


def _stub_worker(conn: mpc.Connection) -> None:
    """A worker that prints its stacks on SIGUSR1 (as the real one does) and stops on the first message."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn.send_bytes(b"up")
    try:
        conn.recv_bytes()
    except EOFError:
        pass


def _workers(on_cuda: bool = False) -> tp_workers.Workers:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_stub_worker, args=(theirs,), daemon=True)
    proc.start()
    theirs.close()
    assert ours.poll(120) and ours.recv_bytes() == b"up"
    return tp_workers.Workers([proc], [ours], on_cuda=on_cuda)


@pytest.mark.parametrize("stalled", [False, True])
def test_close_drops_the_graphs_before_leaving_the_group(stalled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(tp_workers, "destroy_tensor_parallel", lambda: order.append("destroy") or True)
    monkeypatch.setattr(tp_workers, "abort_tensor_parallel", lambda: order.append("abort") or True)
    workers = _workers(on_cuda=stalled)
    workers.release_graphs = lambda: order.append("release graphs")
    if stalled:  # a peer out of step: abort (needs no peer), beside dropping the graphs, never a collective destroy
        workers.stalled("a step did not arrive")
    workers.close()
    if stalled:
        assert sorted(order) == ["abort", "release graphs"]
    else:
        assert order == ["release graphs", "destroy"]
    assert not workers.procs[0].is_alive() and workers.procs[0].exitcode == 0  # it stopped on STOP, not killed


class _NeverReady:
    """A step output whose device work never finishes (a collective waiting on a stuck peer)."""

    def ready(self) -> bool:
        return False

    def result(self) -> Any:
        raise AssertionError("not ready")


def test_a_step_output_that_never_arrives_raises_with_the_workers_stacks(capfd: pytest.CaptureFixture[str]) -> None:
    workers = _workers()
    try:
        start = time.monotonic()
        with pytest.raises(tp_workers.WorkerDied, match="did not arrive within 1 s"):
            tp_workers.WatchedOutput(_NeverReady(), workers, timeout_s=1.0).result()  # type: ignore[arg-type]
        assert time.monotonic() - start < 5
        assert workers.dead is not None and "out of step" in workers.dead  # later steps refuse at once
        assert "most recent call first" in capfd.readouterr().err  # the worker's stacks
    finally:
        workers.close()


def _rank_check(rank: int, port: int, value: int, out: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    parallel_state.init_tensor_parallel(rank, 2, store, torch.device("cpu"), 30.0)
    try:
        parallel_state.check_same_across_ranks(value, "the graphs")
        out.put((rank, "ok"))
    except RuntimeError as exc:
        out.put((rank, str(exc)))
    finally:
        parallel_state.destroy_tensor_parallel()


@pytest.mark.parametrize("values", [(7, 7), (7, 8)])
def test_ranks_that_would_capture_different_graphs_fail_clearly(values: tuple[int, int]) -> None:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_check, args=(r, store.port, v, out), daemon=True) for r, v in enumerate(values)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    if values[0] == values[1]:
        assert results == {0: "ok", 1: "ok"}
    else:
        assert all("ranks disagree on the graphs" in results[r] for r in (0, 1))
        assert "rank 1 has 8" in results[1]
