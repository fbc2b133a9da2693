"""torchrun restarts (runtime/elastic.py): a restarted rank that fails to connect is told why
(issue 28 item 4: "Connection refused" and nothing said that the store outlived the previous
attempt); the attempt-scoped store exists only under torchrun's agent store. The restarts
themselves: tests/test_resume_torchrun.py."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dcp_opt.runtime import GroupPool
from dcp_opt.runtime.elastic import attempt_store, restart_hint

from dcp_opt import DcpOptError

CPU = torch.device("cpu")
REFUSED = RuntimeError(
    "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
    "Connection refused, remote=[127.0.0.1]:23468"
)


def test_a_restarted_rank_that_cannot_connect_is_told_why(monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restart_hint(REFUSED) is None  # a first attempt: nothing stale to explain
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_hint(RuntimeError("some other failure")) is None
    hint = restart_hint(REFUSED)
    assert "torchrun restart 2 without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in hint
    assert "previous attempt" in hint and "init_world" in hint
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # --master_port needs more
    hint = restart_hint(REFUSED)
    assert "without" not in hint and "init_world" in hint and "--master_port" in hint


def test_attempt_store_only_under_torchruns_agent_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(10) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_store(10) is None


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=7))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_group_pool_explains_a_restart_that_reads_stale_addresses(world_of_one, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")

    def refused(*args, **kwargs):
        raise REFUSED

    monkeypatch.setattr(dist, "new_group", refused)
    with pytest.raises(DcpOptError, match="torchrun restart 1") as got:
        GroupPool.create()
    assert got.value.__cause__ is REFUSED


def test_pool_groups_take_the_world_groups_timeout(world_of_one):
    # torch's new_group alone gives gloo groups 30 minutes, whatever the world group has
    assert dist.new_group([0])._get_backend(CPU).options._timeout == timedelta(minutes=30)
    pool = GroupPool.create()
    group = pool.get(0, 1)
    assert group._get_backend(CPU).options._timeout == timedelta(seconds=7)
