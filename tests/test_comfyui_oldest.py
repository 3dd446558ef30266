"""The compatibility leg: ComfyUI 0.3.64 (October 2025), the oldest version the pack supports.

Every other ComfyUI and browser test runs against ComfyUI 0.33 (tests/testbed.py's CURRENT); this short module
starts the 0.3.64 test bed (OLDEST) and checks what a user of that version relies on: the pack loads with no import
failure; the three original example workflows (PixArt-α, SD3, Flux) load, convert and run in 0.3.64's own frontend
in Chromium and save the latents diffusers' single-process pipeline gives (1e-4); and xDiT Model under KSampler and
SamplerCustomAdvanced equals 0.3.64's own model of the same weights. Where the two versions differ, the pack's code
lives in nodes/comfy_compat.py.
"""

from __future__ import annotations

import json

import pytest

from comfyui_page import POOL_ERROR, run_workflow
from comfyui_server import ComfyServer
from test_comfyui_browser import EXAMPLE_FAMILIES, assert_example_equals_diffusers
from test_comfyui_model import compare, graph, latents_of, save_checkpoint
from xdit_test_helpers import ROOT

NODES = {"XDiTPool", "XDiTTextEncode", "XDiTSampler", "XDiTLoRA", "XDiTCache", "XDiTVAEDecode", "XDiTModel",
         "XDiTEmptyLatent"}


@pytest.fixture(scope="module")
def oldest(comfyui_oldest_install, tmp_path_factory):
    """A ComfyUI 0.3.64 server with this pack, for this module."""
    server = ComfyServer(*comfyui_oldest_install, tmp_path_factory.mktemp("comfy_oldest"))
    yield server
    server.stop()
    assert "IMPORT FAILED" not in server.log.read_text()



PAGE_SERVER = "oldest"  # conftest's page: on this module's 0.3.64 server


def test_it_is_comfyui_0_3_64_and_the_pack_loads_with_no_import_failure(oldest):
    assert oldest.get("/system_stats")["system"]["comfyui_version"] == "0.3.64"
    info = oldest.get("/object_info")
    assert NODES <= set(info) and all(info[node]["category"] == "sampling/xDiT" for node in NODES)
    log = oldest.log.read_text()
    timings = log.split("Import times for custom nodes:\n")[1].split("\n\n")[0]
    assert "comfyui-xdit-pool" in timings and "IMPORT FAILED" not in log


@pytest.mark.parametrize("stem", sorted(EXAMPLE_FAMILIES))
def test_original_example_workflows_run_in_its_frontend_and_equal_diffusers(oldest, page, tiny_model_dirs, stem):
    workflow = json.loads((ROOT / "example_workflows" / f"{stem}.json").read_text())
    result, status = run_workflow(page, workflow)
    assert status["status_str"] == "success", json.dumps(status)[-2000:]
    assert page.eval(POOL_ERROR) == ""
    assert_example_equals_diffusers(oldest, result["prompt"], result["response"]["prompt_id"], stem, tiny_model_dirs)


def test_xdit_model_under_comfyuis_samplers_equals_its_own_model(oldest):
    """KSampler ((euler, simple), (dpmpp_2m, karras)) and SamplerCustomAdvanced + CFGGuider on xDiT Model (a
    Ulysses-2 pool) against the same on 0.3.64's UNETLoader of the same SD3 weights (tests/test_comfyui_model.py)."""
    save_checkpoint(oldest.work)
    entry = oldest.wait(oldest.queue(graph({"ulysses_degree": 2}, stock=True)), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latents = latents_of(oldest, entry)
    compare(latents, latents)
    assert (latents["stock-euler"] - latents["stock-dpmpp_2m"]).abs().max().item() > 1e-2  # the samplers differ
