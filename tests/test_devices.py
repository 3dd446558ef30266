"""parallel/distributed/devices.py's decisions with the CUDA queries stubbed (no GPU here): peer access available (nothing
changes), missing (NCCL_P2P_DISABLE=1, said in the log and the status, nothing refused), mixed cards (reported;
rank 0 on the largest card; the smallest sets the limit), more ranks than cards (one line, unless --share-gpus),
a NCCL_P2P_DISABLE the user set (kept), no CUDA (gloo, nothing to decide). The pool CLI refuses --nproc above
--devices before anything starts; the pool's status carries the fields (checked on a CPU pool in test_bf16_fp8.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallel.distributed import devices
from parallel.layout.config import LayoutError, ParallelConfig
from parallel.distributed.devices import Card, DeviceError, plan_devices

from xdit_test_helpers import ROOT

GIB = 2**30
H100 = ("NVIDIA H100 80GB HBM3", 80 * GIB, 132, (9, 0))
RTX4090 = ("NVIDIA GeForce RTX 4090", 24 * GIB, 128, (8, 9))
RTX3060 = ("NVIDIA GeForce RTX 3060", 12 * GIB, 28, (8, 6))


class Stub:
    """The three device queries: these cards, and peer access where `peer(a, b)` says; records what was asked."""

    def __init__(self, *cards, peer=lambda a, b: True):
        self.cards, self._peer, self.asked = cards, peer, []

    def count(self) -> int:
        return len(self.cards)

    def card(self, index: int) -> Card:
        return Card(index, *self.cards[index])

    def peer(self, source: int, target: int) -> bool:
        self.asked.append((source, target))
        return self._peer(source, target)


def test_peer_access_available_changes_nothing():
    plan = plan_devices(2, Stub(H100, H100), environment={})
    assert (plan.p2p, plan.environment, plan.backend, plan.notes) == ("on", {}, "nccl", ())
    assert [plan.device_of(r) for r in range(2)] == [0, 1]  # rank r on card r, as before
    assert plan.status() == {"p2p": "on", "mixed_cards": False, "cards": [
        {"rank": r, "index": r, "name": H100[0], "memory_bytes": H100[1], "multiprocessors": 132, "capability": (9, 0)}
        for r in range(2)]}


def test_missing_peer_access_disables_nccl_p2p_and_says_so(monkeypatch, capsys):
    stub = Stub(RTX4090, RTX4090, peer=lambda a, b: False)
    plan = plan_devices(2, stub, environment={})
    assert plan.p2p == "off" and plan.environment == {"NCCL_P2P_DISABLE": "1"} and plan.backend == "nccl"
    assert set(stub.asked) == {(0, 1), (1, 0)}
    assert "NCCL peer-to-peer off (NCCL_P2P_DISABLE=1): cards without peer access (0→1, 1→0)" in plan.notes[0]
    monkeypatch.setenv("NCCL_P2P_DISABLE", "unset by the test")  # restored after it, as is the module's plan
    monkeypatch.setattr(devices, "_PLAN", None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    placed = []
    monkeypatch.setattr("torch.cuda.set_device", placed.append)
    devices.apply(plan)
    assert placed == [0] and __import__("os").environ["NCCL_P2P_DISABLE"] == "1"
    assert "xdit: NCCL peer-to-peer off" in capsys.readouterr().out
    assert devices.status_fields()["p2p"] == "off"


def test_peer_access_missing_in_one_direction_is_missing():
    plan = plan_devices(2, Stub(RTX4090, RTX4090, peer=lambda a, b: (a, b) != (1, 0)), environment={})
    assert plan.p2p == "off" and "(1→0)" in plan.notes[0]


def test_only_the_cards_the_ranks_use_are_checked():
    """2 ranks on a 4-card box whose third card has no peer access: cards 0 and 1 talk, so nothing changes."""
    stub = Stub(H100, H100, RTX3060, H100, peer=lambda a, b: 2 not in (a, b))
    plan = plan_devices(2, stub, environment={})
    assert plan.p2p == "on" and plan.order == (0, 1) and not plan.mixed
    assert all(2 not in pair and 3 not in pair for pair in stub.asked)


def test_a_user_setting_of_nccl_p2p_disable_is_kept():
    missing = Stub(RTX4090, RTX4090, peer=lambda a, b: False)
    plan = plan_devices(2, missing, environment={"NCCL_P2P_DISABLE": "0"})
    assert plan.p2p == "on" and plan.environment == {} and "as set" in plan.notes[0]
    assert plan_devices(2, Stub(H100, H100), environment={"NCCL_P2P_DISABLE": "1"}).p2p == "off"


def test_mixed_cards_are_reported_and_rank_0_gets_the_largest():
    plan = plan_devices(2, Stub(RTX3060, RTX4090), environment={})
    assert plan.mixed and plan.order == (1, 0) and plan.smallest.name == RTX3060[0]
    assert [row["name"] for row in plan.status()["cards"]] == [RTX4090[0], RTX3060[0]]  # rank 0, rank 1
    note = plan.notes[-1]
    assert note.startswith("mixed cards: ") and "cuda:0 NVIDIA GeForce RTX 3060 (12 GiB, 28 SMs) sets the limit" in note
    assert "rank 0 (text encoders, VAE, client endpoint) runs on cuda:1" in note
    same_memory = plan_devices(2, Stub(RTX4090, ("NVIDIA RTX 4500 Ada", 24 * GIB, 60, (8, 9))), environment={})
    assert same_memory.mixed and same_memory.order == (0, 1)  # a slower card of the same memory: reported, not moved


def test_more_ranks_than_cards_is_refused_in_one_line_unless_shared():
    with pytest.raises(DeviceError) as refused:
        plan_devices(3, Stub(RTX4090, RTX4090), environment={})
    assert str(refused.value).startswith("3 ranks on this machine but 2 CUDA cards") and "--share-gpus" in str(refused.value)
    assert "\n" not in str(refused.value)
    shared = plan_devices(3, Stub(RTX4090, RTX4090), share_gpus=True, environment={})
    assert shared.shared and shared.backend == "gloo" and [shared.device_of(r) for r in range(3)] == [0, 1, 0]
    assert plan_devices(2, Stub(H100), share_gpus=True, environment={}).p2p == "n/a"  # one card: nothing to reach


def test_without_cuda_there_is_nothing_to_decide():
    plan = plan_devices(4, Stub(), environment={})
    assert (plan.backend, plan.p2p, plan.device_of(3), plan.status()) == ("gloo", "n/a", None, {"p2p": "n/a", "cards": [], "mixed_cards": False})


def test_rank_count_checked_before_a_pool_starts():
    devices.check_rank_count(2, "0,1", False)
    devices.check_rank_count(8, None, False, Stub())  # a CPU machine: CPU ranks
    devices.check_rank_count(3, "0,1", True)
    with pytest.raises(DeviceError, match=r"^--nproc 3 but --devices 0,1 names 2 CUDA cards: .* --nproc 2, or add --share-gpus"):
        devices.check_rank_count(3, "0,1", False)
    with pytest.raises(DeviceError, match="^--nproc 2 but this machine has 1 CUDA card:"):
        devices.check_rank_count(2, None, False, Stub(H100))


def test_shared_cards_refuse_what_gloo_cannot_carry():
    ParallelConfig(ulysses_degree=2, share_gpus=True).check(2)
    for layout in ({"ring_degree": 2}, {"pipefusion_degree": 2}, {"dp_degree": 2, "shard_weights": True}):
        with pytest.raises(LayoutError, match="--share-gpus runs the world over gloo"):
            ParallelConfig(**layout, share_gpus=True).check(2)


def test_the_pool_cli_refuses_more_ranks_than_devices_in_one_line():
    run = subprocess.run([sys.executable, "-m", "workers", "serve", "--model", "xdit-tiny-flux", "--nproc", "3",
                          "--devices", "0,1", "--ulysses-degree", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: --nproc 3 but --devices 0,1 names 2 CUDA cards")
    assert len(run.stderr.strip().splitlines()) == 1
