"""`--layout auto`: the prediction picks PipeFusion on a slow link and Ulysses on a fast one, and contract E runs
the layout it picks, exactly.

The decision (bench/link_table.py's model): FLUX.1-dev at 1024² on 2 GPUs, its blocks priced by their
multiply-accumulates at an H100's rate (Ring's attention in two pieces costing a little more, as measured ones do),
with NVLink, PCIe 4.0, 25 GbE and 10 GbE: sequence parallel on NVLink, PipeFusion from PCIe down (as xDiT reports
for PCIe machines); Wan 2.2 at 720p on 8 GPUs. Through real
torchrun ranks: the tiny Flux with `--layout auto` and a link given as 100 kB/s runs PipeFusion; with NVLink, and
measured on this machine, whatever it predicts fastest; each prints its table (fastest first) and equals
diffusers within 1e-4 (PipeFusion with warm-up = steps, so exact). So do Krea 2 (whose attention names its heads
`num_heads`) and Qwen-Image 2.1 (whose call takes no guidance_scale, and whose plan refuses PipeFusion).
"""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file, save_file

from bench import link_table
from bench.link_table import JOBS, block_seconds, winners
from parallel.loading import tiny_models
from parallel.layout.config import Link, ParallelConfig
from parallel.layout.prediction import block_shapes, predict

from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FLUX_DEV_1024 = JOBS["FLUX.1-dev 1024²"]
H100 = 400e12  # dense bf16 FLOP/s


@pytest.mark.parametrize("link, expected", [("nvlink", ("ulysses", "ring")), ("pcie4", ("pipefusion",)),
                                            ("25gbe", ("pipefusion",)), ("10gbe", ("pipefusion",))])
def test_a_slow_link_chooses_pipefusion_and_a_fast_one_sequence_parallel(link, expected):
    """On NVLink Ulysses (its head groups) and Ring (its prefetch) both hide almost all of their traffic: within 1%,
    either may win."""
    chosen, _, _ = winners(FLUX_DEV_1024, H100, 2, Link.parse(link))
    assert chosen.describe() in [f"{method}=2" for method in expected], (link, chosen)


def test_the_link_table_prices_wan_at_720p_on_8_gpus(capsys):
    """Wan 2.2 with CFG on 8 GPUs: CFG parallel always (it sends almost nothing), Ulysses within each branch on a
    fast link, PipeFusion on Ethernet; the table prints every model × GPU count × link."""
    wan = JOBS["Wan 2.2 A14B 720p"]
    assert winners(wan, H100, 8, Link.parse("nvlink"))[0].describe() == "cfg=2 × ulysses=4"
    assert winners(wan, H100, 8, Link.parse("10gbe"))[0].describe() == "cfg=2 × pipefusion=4"
    assert link_table.main([]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" in line]
    assert len(rows) == len(JOBS) * 3 and all(line.count(" ms, ") == 4 for line in rows)


def test_the_link_table_predicts_from_saved_block_measurements(tmp_path, capsys):
    """`--blocks FILE` (what `--measure` saves on a GPU): blocks saved at the --tflops rate give the --tflops table;
    blocks twice as slow give other times, so the file is what prices them. `--measure` needs CUDA: one line, exit 2."""
    assert link_table.main(["--tflops", "400"]) == 0
    priced = [line.split("|", 2)[2] for line in capsys.readouterr().out.splitlines() if " ms, " in line]
    for factor, same in ((1.0, True), (2.0, False)):
        saved = {"device": "a stand-in card", "dtype": "bf16", "jobs": {
            name: [[*shape, factor * block_seconds(shape, job, H100)] for shape in link_table.shapes_of(job)]
            for name, job in JOBS.items()}}
        path = tmp_path / f"blocks{factor}.json"
        path.write_text(json.dumps(saved))
        assert link_table.main(["--blocks", str(path), "--json", str(tmp_path / "out.json")]) == 0
        out = capsys.readouterr().out
        assert "blocks measured on a stand-in card" in out
        assert ([line.split("|", 2)[2] for line in out.splitlines() if " ms, " in line] == priced) is same
    assert json.loads((tmp_path / "out.json").read_text())["blocks_measured_on"] == "a stand-in card"
    with pytest.raises(SystemExit) as refused:
        link_table.main(["--measure"])
    assert refused.value.code == 2 and capsys.readouterr().err.startswith("error: --measure times the blocks on a CUDA")


def test_predictions_add_up():
    """Ulysses 2 sends what bench/analytic.py counts (both streams sharded), priced at the link's rate (overlap
    off: tests/test_overlap_pricing.py prices it)."""
    job, link = FLUX_DEV_1024, Link.parse("10gbe")
    config = ParallelConfig(ulysses_degree=2, ulysses_overlap_groups=1)
    blocks = {s: block_seconds(s, job, H100) for s in block_shapes(config, job)}
    p = predict(config, job, blocks, link, link)
    s, hd = job.image_tokens + job.text_tokens, job.heads * job.head_dim
    per_layer = 4 * s / 2 * hd * 2 / 2
    gather = job.image_tokens / 2 * job.out_channels * 2
    assert p.bytes_per_step == pytest.approx(job.blocks * per_layer + gather)
    assert p.comm_s == pytest.approx(p.bytes_per_step / link.bytes_per_s + (2 * job.blocks + 1) * link.latency_s)
    assert p.step_s == pytest.approx(p.compute_s + p.comm_s)


def test_links_parse_names_and_numbers():
    assert Link.parse("1.25,30") == Link(pytest.approx(1.25e9), pytest.approx(30e-6))
    assert Link.parse("10gbe") == Link(1.25e9, 30e-6)
    with pytest.raises(ValueError, match="GBYTES_PER_S,LATENCY_US"):
        Link.parse("fast")


@pytest.fixture(scope="module")
def flux_inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto") / "in.safetensors"
    save_file(tiny_models.make_inputs("flux", negative=False), path)
    return path


# The tiny model's blocks are mostly Python: which layout is fastest on a fast link is within this machine's noise,
# but at 100 kB/s the traffic decides.
@pytest.mark.parametrize("link, chosen", [(["--link", "0.0001,10000"], "pipefusion=2"), (["--link", "nvlink"], None),
                                          ([], None)], ids=["slow", "nvlink", "measured"])
def test_contract_e_runs_the_layout_it_predicts_fastest(tiny_model_dirs, flux_inputs, tmp_path, link, chosen):
    output = tmp_path / "out.safetensors"
    run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs["flux"]), "--inputs", str(flux_inputs),
                   "--output", str(output), "--steps", "4", "--guidance-scale", "3.5", "--height", "64", "--width", "64",
                   "--warmup-steps", "4", "--layout", "auto", *link)
    assert run.returncode == 0, run.stderr[-3000:]
    picked = re.search(r"layout auto on 2 ranks chose \[(.+?)\]", run.stdout).group(1)
    assert chosen is None or picked == chosen, run.stdout
    table = [line for line in run.stdout.splitlines() if "ms/step" in line]
    assert len(table) == 3 and picked in table[0]  # Ulysses, Ring, PipeFusion (no CFG, one sample); fastest first
    assert ("links (given)" if link else "links (measured)") in run.stdout
    expected = diffusers_latents(tiny_model_dirs["flux"], "flux", **load_file(flux_inputs), num_inference_steps=4,
                                 guidance_scale=3.5, height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


# Krea 2 unguided (as Turbo samples) takes PipeFusion on the slow link (exact with warm-up = steps); Qwen-Image 2.1
# is never offered it (its plan refuses PipeFusion), so its table holds Ulysses and Ring alone.
@pytest.mark.parametrize("family, guidance, chosen, rows", [("krea2", 0.0, "pipefusion=2", 3),
                                                             ("qwen-image-2.1", 1.0, None, 2)])
def test_contract_e_runs_the_layout_it_predicts_on_2026_families(tiny_model_dirs, tmp_path, family, guidance, chosen,
                                                                  rows):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(family, negative=False), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs[family]), "--inputs", str(inputs),
                   "--output", str(output), "--steps", "4", "--guidance-scale", str(guidance), "--height", "64",
                   "--width", "64", "--warmup-steps", "4", "--layout", "auto", "--link", "0.0001,10000")
    assert run.returncode == 0, run.stderr[-3000:]
    picked = re.search(r"layout auto on 2 ranks chose \[(.+?)\]", run.stdout).group(1)
    table = [line for line in run.stdout.splitlines() if "ms/step" in line]
    assert len(table) == rows and picked in table[0] and (chosen is None or picked == chosen), run.stdout
    assert rows == 3 or not any("pipefusion" in line for line in table)
    expected = diffusers_latents(tiny_model_dirs[family], family, **load_file(inputs), num_inference_steps=4,
                                 guidance_scale=guidance, height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


def test_layout_auto_takes_no_degrees(tiny_model_dirs, flux_inputs, tmp_path):
    run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs["flux"]), "--inputs", str(flux_inputs),
                   "--output", str(tmp_path / "o.safetensors"), "--layout", "auto", "--ulysses-degree", "2")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert run.returncode != 0 and len(errors) == 1 and "--layout auto chooses the degrees itself" in errors[0]
