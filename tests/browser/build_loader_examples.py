"""Rebuild example_workflows/xdit_loader_*.json: ComfyUI 0.33.0's official templates with UNETLoader swapped for
Load Diffusion Model (xDiT Pool), made in the real frontend (run when the loader's inputs change):

    .venv/bin/python tests/browser/build_loader_examples.py

Needs what the browser tests need (see tests/test_comfyui_browser.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # tests/, the repo

from comfyui_page import scratch_page  # noqa: E402
from loader_examples import EXAMPLES, LAYOUT, SWAP, template  # noqa: E402
from xdit_test_helpers import ROOT  # noqa: E402


def main() -> None:
    with scratch_page() as (server, browser):
        for stem in EXAMPLES:
            result = browser.eval(SWAP, {"template": template(server.python, stem), "layout": LAYOUT})
            assert result["swapped"], f"{EXAMPLES[stem]} has no UNETLoader"
            path = ROOT / "example_workflows" / f"{stem}.json"
            path.write_text(json.dumps(result["workflow"], indent=2) + "\n")
            print(f"wrote {path.relative_to(ROOT)} ({result['swapped']} loader(s) swapped)")


if __name__ == "__main__":
    main()
