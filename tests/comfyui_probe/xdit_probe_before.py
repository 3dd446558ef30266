"""A test custom node that ComfyUI loads just before the pack (tests/comfyui_server.py orders the
folders): it notes ComfyUI's sys.path and sys.modules as they were before the pack loaded."""

import sys

NODE_CLASS_MAPPINGS = {}
SNAPSHOT = {"path": list(sys.path), "modules": sorted(sys.modules)}
