"""The loader's example workflows: ComfyUI's own official templates with every UNETLoader swapped for Load Diffusion
Model (xDiT Pool), nothing else changed. Shared by tests/browser/build_loader_examples.py, which writes them, and
tests/test_comfyui_browser_loader.py, which loads, converts and runs them in the real frontend.

The templates are the ones ComfyUI 0.33.0 ships (`comfyui-workflow-templates-json`, installed in the test bed by
its requirements), so an example is what its user opens from ComfyUI's template browser, with one node swapped.
"""

from __future__ import annotations

import json
from pathlib import Path

EXAMPLES = {  # example stem: the official template it is made from
    "xdit_loader_flux2_klein": "image_flux2_klein_text_to_image",
    "xdit_loader_flux2_dev": "image_flux2_text_to_image",
    "xdit_loader_flux_dev": "flux_dev_full_text_to_image",
    "xdit_loader_flux_kontext": "flux_kontext_dev_basic",
    "xdit_loader_krea2": "image_krea2_turbo_t2i",
    "xdit_loader_qwen_image": "image_qwen_Image_2512",
    "xdit_loader_qwen_image_edit": "image_qwen_image_edit_2511",
    "xdit_loader_z_image": "image_z_image_turbo",
    "xdit_loader_wan22_t2v": "video_wan2_2_14B_t2v",
    "xdit_loader_wan22_i2v": "video_wan2_2_14B_i2v",
    "xdit_loader_wan22_ti2v_5b": "video_wan2_2_5B_ti2v",
    "xdit_loader_hunyuan_video15": "video_hunyuan_video_1.5_720p_t2v",
}
LAYOUT = {"nproc": 2, "ulysses_degree": 2}  # what the examples ask of the pool: two ranks, Ulysses 2

# In the page: every UNETLoader of the template (its subgraphs' too) becomes a fresh Load Diffusion Model (xDiT Pool)
# node made by the frontend itself, with the template's file and weight dtype and LAYOUT, keeping the old node's id,
# place, mode and links (a subgraph's promoted unet_name included); then the graph is loaded and saved as ComfyUI
# saves it.
SWAP = """async ({ template, layout }) => {
    const fresh = LiteGraph.createNode('XDiTLoadDiffusionModel');
    const swap = (old) => {
        const values = { unet_name: old.widgets_values[0], weight_dtype: old.widgets_values[1], ...layout };
        for (const widget of fresh.widgets) if (widget.name in values) widget.value = values[widget.name];
        const node = fresh.serialize();
        const links = Object.fromEntries((old.inputs ?? []).map((input) => [input.name, input]));
        node.inputs = (node.inputs ?? []).map((input) => ({ ...input, link: links[input.name]?.link ?? null }));
        for (const [name, input] of Object.entries(links))  // a widget input the fresh node lists no socket for
            if (input.link != null && !node.inputs.some((i) => i.name === name)) node.inputs.push(input);
        node.outputs = node.outputs.map((output, slot) => ({ ...output, links: old.outputs?.[slot]?.links ?? [] }));
        return { ...node, id: old.id, pos: old.pos, size: node.size, order: old.order, mode: old.mode, flags: old.flags };
    };
    const graphs = [template, ...(template.definitions?.subgraphs ?? [])];
    let swapped = 0;
    for (const graph of graphs)
        graph.nodes = graph.nodes.map((node) => node.type === 'UNETLoader' ? (swapped++, swap(node)) : node);
    await app.loadGraphData(template);
    const workflow = app.graph.serialize();
    return { workflow, swapped };
}"""

# In the page: a saved workflow loaded and converted as the Run button converts it (subgraphs flattened, bypassed
# nodes dropped, widget values read), without queueing it.
LOAD_CONVERT = """async (workflow) => {
    await app.loadGraphData(workflow);
    return (await app.graphToPrompt()).output;
}"""


def templates_dir(comfy_python: Path) -> Path:
    """The official templates in the test bed's venv (its python: <venv>/bin/python)."""
    found = sorted(comfy_python.parent.parent.glob("lib/python*/site-packages/comfyui_workflow_templates_json/templates"))
    if not found:
        raise FileNotFoundError(f"no comfyui-workflow-templates-json beside {comfy_python}: rebuild the test bed")
    return found[0]


def template(comfy_python: Path, stem: str) -> dict:
    return json.loads((templates_dir(comfy_python) / f"{EXAMPLES[stem]}.json").read_text())
