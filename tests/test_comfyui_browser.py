"""In the real ComfyUI frontend (headless Chromium): example workflows, the pool panel, degree validation.

Needs the ComfyUI test bed with Node.js, Chromium and npm playwright-core, all from tests/testbed.py;
without them every test here is skipped with the reason, shown by `pytest -rs`. The page is driven by
tests/browser/driver.js over JSON lines.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from comfyui_page import HISTORY, LOAD_CONVERT_QUEUE, POOL_ERROR, RUN_BUTTON
from loader_examples import EXAMPLES as LOADER_EXAMPLES
from test_comfyui import FAMILIES, reference, saved_latent
from xdit_test_helpers import ROOT, TOLERANCE

AV_EXAMPLES = {"xdit_ltx2", "xdit_minimax_h3"}  # video with sound: run in test_comfyui_ltx2 / test_comfyui_minimax_h3
EXAMPLES = sorted(path for path in (ROOT / "example_workflows").glob("*.json")  # the loader's: test_comfyui_browser_loader
                  if path.stem not in {*LOADER_EXAMPLES, *AV_EXAMPLES})
ARTIFACTS = ROOT / "out" / "test-artifacts"



EXAMPLE_FAMILIES = {"xdit_pixart_alpha": "pixart-alpha", "xdit_sd3": "sd3", "xdit_flux": "flux"}  # the original three


def assert_example_equals_diffusers(comfy, prompt: dict, prompt_id: str, stem: str, model_dirs) -> None:
    """The LATENT one of the original example workflows saved equals diffusers' single-process pipeline for the
    prompts, seed, steps, cfg and size the frontend converted the example to (ComfyUI's noise of that seed)."""
    family = EXAMPLE_FAMILIES[stem]
    sampler, empty = (next(n["inputs"] for n in prompt.values() if n["class_type"] == kind)
                      for kind in ("XDiTSampler", FAMILIES[family][0]))
    texts = [prompt[sampler[name][0]] for name in ("positive", "negative")]
    assert [t["class_type"] for t in texts] == ["XDiTTextEncode"] * 2 and sampler["cfg"] == FAMILIES[family][1]
    assert empty["width"] == empty["height"] and sampler["denoise"] == 1.0
    entry = comfy.get(f"/history/{prompt_id}")[prompt_id]
    latent = saved_latent(comfy, entry, next(iter(entry["outputs"])))
    expected = reference(model_dirs[family], family, steps=sampler["steps"], size=empty["width"], seed=sampler["seed"],
                         positive=texts[0]["inputs"]["text"], negative=texts[1]["inputs"]["text"])
    assert latent.shape == expected.shape
    assert (latent - expected).abs().max().item() <= TOLERANCE, stem
    assert expected.abs().max().item() > 0.1  # a real latent, not zeros


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_workflow_loads_converts_and_runs(comfy, page, tiny_model_dirs, path):
    workflow = json.loads(path.read_text())
    result = page.eval(LOAD_CONVERT_QUEUE, workflow)
    sd3_latent = ("xdit_sd3", "xdit_flux", "xdit_flux_kontext", "xdit_qwen_image", "xdit_qwen_image_edit", "xdit_z_image",
                  "xdit_model_ksampler", "xdit_krea2")
    empty = {**dict.fromkeys(sd3_latent, "EmptySD3LatentImage"), "xdit_wan": "EmptyHunyuanLatentVideo",
             **dict.fromkeys(("xdit_flux2_klein", "xdit_flux2_dev"), "EmptyFlux2LatentImage"),
             **dict.fromkeys(("xdit_flux3", "xdit_qwen_image21"), "XDiTEmptyLatent"),
             "xdit_hunyuan_video15": "EmptyHunyuanVideo15Latent"}.get(path.stem, "EmptyLatentImage")
    edit = {"xdit_flux_kontext": ["XDiTSampler", "ReferenceLatent"],  # a first sampler's image as reference
            "xdit_qwen_image_edit": ["LoadImage"]}.get(path.stem, [])  # ComfyUI's example.png, encoded with the prompts
    sampler = ["XDiTModel", "KSampler"] if path.stem == "xdit_model_ksampler" else ["XDiTSampler"]
    assert result["classes"] == sorted(["XDiTPool", "XDiTTextEncode", "XDiTTextEncode", *sampler, "SaveLatent", empty, *edit])
    assert result["response"] and not result["response"].get("node_errors"), result
    status = page.wait(HISTORY, result["response"]["prompt_id"], timeout_s=120)
    assert status["status_str"] == "success", json.dumps(status)[-2000:]
    assert page.eval(POOL_ERROR) == ""
    if path.stem in EXAMPLE_FAMILIES:
        assert_example_equals_diffusers(comfy, result["prompt"], result["response"]["prompt_id"], path.stem, tiny_model_dirs)


def test_example_workflows_cover_every_family_and_are_listed_as_templates(comfy):
    stems = {"xdit_pixart_alpha", "xdit_pixart_sigma", "xdit_sd3", "xdit_flux", "xdit_wan", "xdit_flux_kontext",
             "xdit_qwen_image", "xdit_qwen_image_edit", "xdit_z_image", "xdit_model_ksampler", "xdit_flux2_klein",
             "xdit_flux2_dev", "xdit_hunyuan_video15", "xdit_flux3", "xdit_krea2", "xdit_qwen_image21"}
    assert {p.stem for p in EXAMPLES} == stems
    assert set(comfy.get("/api/workflow_templates")["comfyui-xdit-pool"]) == stems | set(LOADER_EXAMPLES) | AV_EXAMPLES


def _open_panel(page) -> None:
    page.eval("() => document.querySelector('.xdit-panel') || document.querySelector('.pi-sitemap').click()")
    page.wait("() => document.querySelector('.xdit-panel')", timeout_s=10)


def test_panel_streams_steps_live_on_a_cfg_x_ulysses_mesh(comfy, page, tmp_path):
    """A long job on a cfg 2 × ulysses 2 pool: its step shows live in all four rank cells; then it is interrupted."""
    workflow = json.loads((ROOT / "example_workflows" / "xdit_pixart_alpha.json").read_text())
    for node in workflow["nodes"]:
        if node["type"] == "XDiTPool":  # model, nproc, ulysses, ring, pipefusion, patches, warmup, cfg_parallel, …
            node["widgets_values"][1], node["widgets_values"][7] = 4, True
        if node["type"] == "XDiTSampler":  # seed, control_after_generate, steps, cfg, …
            node["widgets_values"][2] = 1000  # the most it takes: a loaded box must not finish before the interrupt
    _open_panel(page)
    prompt_id = page.eval(LOAD_CONVERT_QUEUE, workflow)["response"]["prompt_id"]
    cells = page.wait("""() => {
        const pool = [...document.querySelectorAll('.xdit-pool[data-state="busy"]')].find(
            (p) => p.querySelectorAll('.xdit-rank').length === 4);
        const cells = pool && [...pool.querySelectorAll('.xdit-rank')].map((e) => ({
            rank: +e.dataset.rank, cfg: +e.dataset.cfg, ulysses: +e.dataset.ulysses,
            step: e.querySelector('.xdit-rank-step').innerText }));
        return cells && /^([2-9]|\\d\\d+)\\/1000$/.test(cells[0].step) && cells;
    }""", timeout_s=90)
    shot = tmp_path / "xdit-panel.png"
    page.eval("() => document.querySelector('.xdit-pool[data-state=\"busy\"]').scrollIntoView({ block: 'center' })")
    page.call("screenshot", path=str(shot), selector=".sidebar-content-container")
    comfy.post("/interrupt")
    assert [(c["rank"], c["cfg"], c["ulysses"]) for c in cells] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert len({c["step"] for c in cells}) == 1
    status = page.wait(HISTORY, prompt_id, timeout_s=60)
    assert any(m[0] == "execution_interrupted" for m in status["messages"]), status
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "xdit-panel.png")
    assert shot.stat().st_size > 10_000


def test_panel_shows_one_cell_per_rank_of_every_pool(comfy, page):
    pools = comfy.get("/xdit/pools")["pools"]
    assert len(pools) >= 4, "the pools of the example workflows are missing (run the whole module)"
    _open_panel(page)
    expected = sum(p["key"]["nproc"] for p in pools)
    cells = page.wait("""(expected) => {
        const cells = [...document.querySelectorAll('.xdit-panel .xdit-rank[data-rank]')];
        return cells.length === expected && cells.map((c) => ({ rank: +c.dataset.rank,
            pool: c.closest('.xdit-pool').dataset.poolId, state: c.dataset.state }));
    }""", expected, timeout_s=20)
    for pool in pools:
        mine = [c for c in cells if c["pool"] == pool["id"]]
        assert sorted(c["rank"] for c in mine) == list(range(pool["key"]["nproc"]))
    states = {p["id"]: p["status"]["state"] for p in comfy.get("/xdit/pools")["pools"]}
    assert set(states.values()) == {"idle"}
    page.wait("""(states) => Object.entries(states).every(([id, state]) => [...document.querySelectorAll(
        `.xdit-pool[data-pool-id="${id}"] .xdit-rank`)].every((cell) => cell.dataset.state === state))""",
              states, timeout_s=10)
    memory_rows = page.wait("""(expected) => {
        const rows = document.querySelectorAll('.xdit-panel .xdit-memory tr[data-rank]').length;
        return rows === expected && rows;
    }""", expected, timeout_s=10)
    assert memory_rows == expected
    calls = {p["id"]: p["status"]["model_calls"] for p in pools if p["status"].get("model_calls")}
    assert calls, "the KSampler example (xDiT Model) made no model calls"
    shown = page.eval("""(ids) => ids.map((id) => document.querySelector(
        `.xdit-pool[data-pool-id="${id}"] .xdit-chip[data-fact="model calls"] b`)?.innerText)""", list(calls))
    assert shown == [str(n) for n in calls.values()]
    storage = {p["id"]: " + ".join(p["status"]["storage"]) for p in pools}  # the weights' storage formats
    assert all(storage.values())
    shown = page.eval("""(ids) => ids.map((id) => document.querySelector(
        `.xdit-pool[data-pool-id="${id}"] .xdit-chip[data-fact="weights"] b`)?.innerText)""", list(storage))
    assert shown == list(storage.values())
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.call("screenshot", path=str(ARTIFACTS / "xdit-page.png"))


def test_layout_auto_ignores_the_degrees_and_the_panel_shows_its_prediction_table(comfy, page):
    """The Flux example with xDiT Pool's layout set to auto (and degrees that would not multiply to nproc): the
    node is not flagged, the workflow runs, and the pool's card lists each layout's predicted step time, fastest
    (the one that ran) first, as the pool's status has them."""
    workflow = json.loads((ROOT / "example_workflows" / "xdit_flux.json").read_text())
    for node in workflow["nodes"]:
        if node["type"] == "XDiTPool":  # model, nproc, ulysses, …, vae, layout (the 20th)
            node["widgets_values"][2] = 3
            node["widgets_values"][19:] = ["auto"]
    _open_panel(page)
    queued = page.eval(LOAD_CONVERT_QUEUE, workflow)
    assert page.eval(POOL_ERROR) == ""
    status = page.wait(HISTORY, queued["response"]["prompt_id"], timeout_s=240)
    assert status["status_str"] == "success", status
    pool = next(p for p in comfy.get("/xdit/pools")["pools"] if p["key"]["auto"])
    last = pool["status"]["layout_auto"]["last"]
    assert last["layout"] == pool["status"]["parallel"]["description"]
    rows = page.wait("""(id) => {
        const rows = [...document.querySelectorAll(`.xdit-pool[data-pool-id="${id}"] .xdit-layout-auto tr[data-layout]`)];
        return rows.length && rows.map((r) => [r.dataset.layout, r.dataset.chosen]);
    }""", pool["id"], timeout_s=20)
    assert rows == [[row["layout"], "true" if i == 0 else "false"] for i, row in enumerate(last["predictions"])]
    assert rows[0][0] == last["layout"]
    page.eval(f"() => document.querySelector('.xdit-pool[data-pool-id=\"{pool['id']}\"] .xdit-layout-auto')"
              ".scrollIntoView({ block: 'center' })")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.call("screenshot", path=str(ARTIFACTS / "xdit-layout-auto.png"), selector=".sidebar-content-container")


def test_stop_and_restart_buttons(comfy, page):
    pool = next(p for p in comfy.get("/xdit/pools")["pools"] if "sd3" in p["label"])
    card = f'.xdit-pool[data-pool-id="{pool["id"]}"]'
    _open_panel(page)
    page.call("click", selector=f"{card} .xdit-stop")
    cell_states = f"() => [...document.querySelectorAll('{card} .xdit-rank')].map((c) => c.dataset.state).join()"
    page.wait(f"() => ({cell_states})() === 'stopped,stopped'", timeout_s=30)
    assert _state(comfy, pool["id"]) == "stopped"
    page.call("click", selector=f"{card} .xdit-restart")
    page.wait(f"() => document.querySelector('{card}').dataset.state === 'idle'", timeout_s=90)
    assert _state(comfy, pool["id"]) == "idle"


def _state(comfy, pool_id: str) -> str:
    return next(p for p in comfy.get("/xdit/pools")["pools"] if p["id"] == pool_id)["status"]["state"]


def test_bad_degree_product_is_flagged_and_not_queued(comfy, page):
    workflow = json.loads((ROOT / "example_workflows" / "xdit_sd3.json").read_text())
    page.eval("async (workflow) => { await app.loadGraphData(workflow); return true; }", workflow)
    assert page.eval(POOL_ERROR) == ""
    before = (len(comfy.get("/history")), comfy.get("/queue"))
    page.call("requests", reset=True)

    flagged = page.eval("""async () => {
        const node = app.graph.nodes.find((n) => n.comfyClass === 'XDiTPool');
        const widget = node.widgets.find((w) => w.name === 'ulysses_degree');
        widget.setValue(3, { node, canvas: app.canvas });
        await node.xditCheck;
        return node.xditError;
    }""")
    assert flagged and "= 3" in flagged and "nproc is 2" in flagged and "ulysses_degree to 2" in flagged
    page.eval("() => { document.querySelector('.xdit-panel') && document.querySelector('.pi-sitemap').click();"
              " app.canvas.ds.offset = [120, 80]; app.canvas.setDirty(true, true); return true; }")

    page.call("click", selector=RUN_BUTTON)  # the Run button, as a user would
    toast = page.wait("() => [...document.querySelectorAll('.p-toast-message')].map((e) => e.innerText).join('\\n')"
                      " .includes('xDiT Pool') && document.querySelector('.p-toast-message').innerText", timeout_s=10)
    assert "nproc is 2" in toast
    time.sleep(0.5)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.call("screenshot", path=str(ARTIFACTS / "xdit-invalid-node.png"))
    assert page.eval("() => app.queuePrompt(0, 1)") is False
    assert page.call("requests") == [], "the frontend sent the invalid prompt to the server"
    assert (len(comfy.get("/history")), comfy.get("/queue")) == before

    fixed = page.eval("""async () => {
        const node = app.graph.nodes.find((n) => n.comfyClass === 'XDiTPool');
        node.widgets.find((w) => w.name === 'ulysses_degree').setValue(1, { node, canvas: app.canvas });
        node.widgets.find((w) => w.name === 'nproc').setValue(1, { node, canvas: app.canvas });
        return await node.xditCheck;
    }""")
    assert fixed == ""

    for node in workflow["nodes"]:  # model, nproc, ulysses, ring, pipefusion, patches, warmup, cfg_parallel, dp, …
        if node["type"] == "XDiTPool":
            node["widgets_values"][7] = True  # cfg 2 × ulysses 2 on 2 ranks
    loaded = page.eval("async (workflow) => { await app.loadGraphData(workflow); return await app.graph.nodes"
                       ".find((n) => n.comfyClass === 'XDiTPool').xditCheck; }", workflow)
    # the server's one message (ParallelConfig.check) since the panel stopped re-implementing it in JavaScript
    assert "cfg 2 × pipefusion 1 × ring 1 × ulysses 2 = 4, but there are 2 ranks (nproc is 2)" in loaded
    assert "set ulysses_degree to 1" in loaded


def test_the_extension_raised_no_errors_in_the_page(page):
    errors = [e for e in page.call("errors") if "xdit" in e.lower()]
    assert not errors, errors
