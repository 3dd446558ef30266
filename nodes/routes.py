"""REST routes for the web panel: list pools with live status, stop or restart one, check an xDiT Pool layout."""

from __future__ import annotations

import asyncio

from aiohttp import web
from server import PromptServer

from .pool_node import layout_error
from .pools import POOLS
from .progress import publish


def _snapshot() -> dict:
    return {"pools": POOLS.describe()}


@PromptServer.instance.routes.get("/xdit/pools")
async def list_pools(request):
    return web.json_response(await asyncio.to_thread(_snapshot))


@PromptServer.instance.routes.post("/xdit/layout/check")
async def check_layout(request):
    """An xDiT Pool node's widget values → {"error": "..."} ("" when its layout fits its nproc): the graph flags a
    node and refuses to queue with the server's own check (ParallelConfig.check), not a copy of it."""
    values = await request.json()
    if not isinstance(values, dict):
        return web.json_response({"error": "send the node's widget values as a JSON object"}, status=400)
    return web.json_response({"error": layout_error(values)})


async def _act(request, action) -> web.Response:
    key = POOLS.find(request.match_info["pool_id"])
    if key is None:
        return web.json_response({"error": "no such pool"}, status=404)
    try:
        await asyncio.to_thread(action, key)
    except Exception as error:  # noqa: BLE001 - shown to the user in the panel
        return web.json_response({"error": str(error)}, status=500)
    snapshot = await asyncio.to_thread(_snapshot)
    publish("xdit.pool.update", snapshot)
    return web.json_response(snapshot)


@PromptServer.instance.routes.post("/xdit/pools/{pool_id}/stop")
async def stop_pool(request):
    return await _act(request, POOLS.stop)


@PromptServer.instance.routes.post("/xdit/pools/{pool_id}/restart")
async def restart_pool(request):
    return await _act(request, POOLS.restart)
