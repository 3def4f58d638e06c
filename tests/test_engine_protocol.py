"""`LLM` and `ReplicaPool` are both an `Engine`, the surface a job reads: every member there, each
method taking every call the protocol allows. One `LLM` reports itself as one process (its own
start-up, no replica table). A live pool is checked in tests/test_scale_out.py, on a cluster."""

from __future__ import annotations

import inspect

import pytest

from pagedctl.engine import LLM, Engine, Replicas


def methods(protocol: type) -> dict[str, inspect.Signature]:
    """The protocol's methods and their signatures (self left out)."""
    return {
        name: inspect.signature(member)
        for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def assert_takes(impl: type, protocol: type) -> None:
    """`impl` has each of the protocol's methods, taking the fullest and the barest call the
    protocol's signature allows (positional parameters by position, keyword-only by name)."""
    for name, proto in methods(protocol).items():
        impl_sig = inspect.signature(getattr(impl, name))
        params = list(proto.parameters.values())[1:]
        for chosen in (params, [p for p in params if p.default is inspect.Parameter.empty]):
            args = [p.name for p in chosen if p.kind is not inspect.Parameter.KEYWORD_ONLY]
            kwargs = {p.name: p.name for p in chosen if p.kind is inspect.Parameter.KEYWORD_ONLY}
            impl_sig.bind("self", *args, **kwargs)  # TypeError: the call is refused


def test_methods_lists_the_protocol_surface():
    assert set(methods(Engine)) == {"stream", "abort_all", "snapshots", "close"}
    assert set(methods(Replicas)) == {"shares", "deaths"}


def test_one_llm_is_an_engine_of_one_process():
    assert_takes(LLM, Engine)
    llm = LLM("tiny-llama", device="cpu", num_blocks=16, max_num_seqs=2)
    assert isinstance(llm, Engine)
    assert llm.replicas is None  # no replica table
    assert llm.startup == llm.snapshot()["startup"]
    assert [s["running"] for s in llm.snapshots()] == [0]
    outs = list(llm.stream([{"prompt_token_ids": [1, 5, 9]}], should_stop=None, max_requests=1))
    assert len(outs) == 1 and outs[0].ok
    llm.close()
    assert llm.runner is None


def test_a_replica_pool_is_an_engine_in_shape():
    pytest.importorskip("ray")
    from pagedctl.engine.scale_out.ray_data import ReplicaPool, ReplicaTally

    assert_takes(ReplicaPool, Engine)
    assert_takes(ReplicaTally, Replicas)
