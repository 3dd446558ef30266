"""A test custom node that ComfyUI loads just after the pack: GET /xdit-test/probe answers sys.path and
sys.modules before the pack, just after it, and now, so a test sees what loading the pack changed."""

import sys

from aiohttp import web
from server import PromptServer

NODE_CLASS_MAPPINGS = {}
SNAPSHOT = {"path": list(sys.path), "modules": sorted(sys.modules)}


@PromptServer.instance.routes.get("/xdit-test/probe")
async def probe(request):
    before = next(m for name, m in sys.modules.items() if name.endswith("/xdit_probe_before")).SNAPSHOT  # keyed by path
    now = {"path": list(sys.path), "modules": sorted(sys.modules)}
    return web.json_response({"before": before, "after": SNAPSHOT, "now": now})
