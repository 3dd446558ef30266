"""The overlap priced (parallel/layout/overlap.py, prediction.py): head groups only where a group's attention hides
more transfer than its extra messages' latency costs, and `--layout auto`'s prediction of an overlapped layout
lower than the same layout without overlap by exactly what it hides. Arithmetic only, no timing: the fixtures are
the two cases measured in bench/RESULTS.md ("Overlapped Ulysses, on loopback and under an emulated PCIe link").
"""

from __future__ import annotations

import pytest

from bench.link_table import JOBS, block_seconds
from parallel.layout.config import LINKS, Link, ParallelConfig
from parallel.layout.overlap import AttentionLayer
from parallel.layout.prediction import Job, attention_share, block_shapes, predict

H100 = 400e12
# bench diffusers-cp --link pcie4: this CPU 3,879× slower than an H100, the PCIe link stretched alike
PCIE_STRETCHED = Link(LINKS["pcie4"][0] / 3879, LINKS["pcie4"][1] * 3879)  # 39 ms a message
MEDIUM = Job(image_tokens=1024, text_tokens=128, text_splits=True, heads=8, head_dim=64, hidden=512, blocks=8,
             out_channels=64, element_bytes=4, batch=1, steps=1, branches=1)


def medium_u2_layer() -> AttentionLayer:
    """One of the medium model's 8 layers under U2: 18.1 MiB a step, 0.45 s of compute a step on a rank."""
    nbytes = 18.1 * 2**20 / MEDIUM.blocks
    shape = block_shapes(ParallelConfig(ulysses_degree=2), MEDIUM)[0]
    return AttentionLayer(0.45 / MEDIUM.blocks * attention_share(shape, MEDIUM), 0.75 * nbytes, 0.25 * nbytes)


def overlap_bench_layer() -> AttentionLayer:
    """bench.overlap: 16 heads × 2,048 tokens × 64 in fp32 on 2 ranks (8 heads each), at this CPU's 0.103 TFLOP/s."""
    send = 3 * 1024 * 16 * 64 * 4 / 2  # Q/K/V: half of each rank's tokens leave
    return AttentionLayer(2 * 2 * 2048 * 2048 * 8 * 64 / 0.103e12, send, send / 3)


def test_latency_dominating_keeps_the_heads_in_one_group():
    """Medium Flux under emulated PCIe: 2 groups measured 0.50 s a step slower (4.60 s against 4.09 s); the model
    prices about as much extra and keeps one group."""
    layer = medium_u2_layer()
    assert layer.best_groups(4, PCIE_STRETCHED, PCIE_STRETCHED) == 1
    extra = MEDIUM.blocks * (layer.seconds(2, PCIE_STRETCHED, PCIE_STRETCHED)
                             - layer.seconds(1, PCIE_STRETCHED, PCIE_STRETCHED))
    assert 0.35 < extra < 0.65


def test_transfer_of_the_size_of_the_compute_takes_several_groups():
    """bench.overlap on 0.2 GB/s: 2, 4 and 8 groups measured 1.17×, 1.24× and 1.32× faster than one; the model
    prices each within 10% and takes more than one group."""
    layer, link = overlap_bench_layer(), Link.parse("0.2,30")
    one = layer.seconds(1, link, link)
    for groups, measured in ((2, 1.17), (4, 1.24), (8, 1.32)):
        assert one / layer.seconds(groups, link, link) == pytest.approx(measured, rel=0.1)
    assert layer.best_groups(8, link, link) > 1


def test_what_overlap_hides_is_at_most_the_transfer_and_the_compute():
    link = Link.parse("0.2,30")
    for layer in (overlap_bench_layer(), AttentionLayer(0.01, 0.0, 0.0, ring=4, exchange_bytes=4e6),
                  AttentionLayer(0.5, 0.0, 0.0, ring=2, exchange_bytes=1e6)):
        for groups in (1, 2, 8):
            hidden = layer.serial_seconds(link, link) - layer.seconds(groups, link, link)
            transfer = layer.serial_seconds(link, link) - layer.attention_s
            assert hidden <= min(transfer, layer.attention_s) + 1e-12
    # Ring over 2: its one exchange wholly behind the local block's attention, when that is the longer
    ring = AttentionLayer(0.5, ring=2, exchange_bytes=1e6)
    assert ring.seconds(1, link, link) == pytest.approx(0.5)


def test_an_overlapped_layout_is_predicted_faster_by_what_it_hides():
    """FLUX.1-dev 1024² on 2 GPUs over PCIe 4.0: U2 takes the head groups that pay, and its prediction is the same
    layout's without overlap less the hidden seconds; Ring's prefetch hides without groups."""
    job, link = JOBS["FLUX.1-dev 1024²"], Link.parse("pcie4")

    def priced(config: ParallelConfig):
        blocks = {s: block_seconds(s, job, H100) for s in block_shapes(config, job)}
        return predict(config, job, blocks, link, link)

    on, off = priced(ParallelConfig(ulysses_degree=2)), priced(ParallelConfig(ulysses_degree=2, ulysses_overlap_groups=1))
    assert on.config.ulysses_overlap_groups > 1 and off.hidden_s == pytest.approx(0.0, abs=1e-12) and on.hidden_s > 0.0
    assert on.step_s == pytest.approx(off.step_s - on.hidden_s)
    assert on.bytes_per_step == off.bytes_per_step and on.compute_s == off.compute_s
    ring = priced(ParallelConfig(ring_degree=2))
    assert ring.hidden_s > 0.0 and ring.config.ulysses_overlap_groups is None
    given = priced(ParallelConfig(ulysses_degree=2, ulysses_overlap_groups=3))
    assert given.config.ulysses_overlap_groups == 3  # the explicit count wins
