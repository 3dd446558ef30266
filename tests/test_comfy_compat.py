"""The V3 API as both supported ComfyUIs have it (0.3.64 and 0.33), without a server: read from their source
snapshots in ../shared/comfyui.

ComfyUI 0.33's `comfy_api.latest.io` exports only its `__all__`, and its InterruptProcessingException derives from
BaseException (0.3.64's from Exception), so: every `io.<name>` the pack uses must be in 0.33's `__all__` and defined
in 0.3.64's io, and the interrupt must be caught by its own name (nodes/comfy_compat.py) whichever base it has.
"""

from __future__ import annotations

import ast
import re
import tarfile
import types

import pytest

from test_families import COMFYUI_CURRENT_SOURCE, COMFYUI_SOURCE
from xdit_test_helpers import ROOT, import_node_module


def _source(archive, member: str) -> str:
    if not archive.is_file():
        pytest.skip(f"no ComfyUI source at {archive}")
    with tarfile.open(archive) as tar:
        return tar.extractfile(member).read().decode()


def _used_io_names() -> set[str]:
    names = set()
    for path in (ROOT / "nodes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "io":
                names.add(node.attr)
    return names


def test_the_pack_uses_only_io_names_both_versions_export():
    used = _used_io_names()
    assert {"ComfyNode", "Schema", "NodeOutput", "Custom", "Latent", "Conditioning"} <= used
    current = ast.parse(_source(COMFYUI_CURRENT_SOURCE, "comfy_api/latest/_io.py"))
    exported = next(ast.literal_eval(node.value) for node in current.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", "") == "__all__" for t in node.targets))
    assert not used - set(exported), f"not in ComfyUI 0.33's comfy_api.latest.io.__all__: {sorted(used - set(exported))}"
    oldest = _source(COMFYUI_SOURCE, "comfy_api/latest/_io.py")
    defined = set(re.findall(r"^(?:class|def) (\w+)|^(\w+) = ", oldest, re.M))
    defined = {name for pair in defined for name in pair if name}
    assert not used - defined, f"not in ComfyUI 0.3.64's io: {sorted(used - defined)}"
    for path in (ROOT / "nodes").glob("*.py"):  # the modules 0.33 removed
        assert not re.search(r"\bcomfy_io\b|\bNodeInfoV3\b|\bComboDynamic\b|\bAutogrowDynamic\b", path.read_text()), path


@pytest.mark.parametrize("base", [Exception, BaseException], ids=["comfyui-0.3.64", "comfyui-0.33"])
def test_the_interrupt_is_caught_by_its_name_whatever_it_derives_from(monkeypatch, base):
    management = types.ModuleType("comfy.model_management")
    management.InterruptProcessingException = type("InterruptProcessingException", (base,), {})
    management.processing_interrupted = lambda: True
    management.throw_exception_if_processing_interrupted = lambda: None
    comfy = types.ModuleType("comfy")
    comfy.model_management = management
    compat = import_node_module(monkeypatch, "comfy_compat", {"comfy": comfy, "comfy.model_management": management})

    class Progress:
        def update_absolute(self, value, total, preview=None):
            if value == 3:
                raise management.InterruptProcessingException()  # ComfyUI's progress hook, on an interrupt

    assert compat.progress_interrupted(Progress(), 2, 10) is False
    assert compat.progress_interrupted(Progress(), 3, 10) is True
    assert compat.interrupt_requested() is True
    with pytest.raises(management.InterruptProcessingException):
        compat.raise_interrupted()
    assert issubclass(management.InterruptProcessingException, Exception) == (base is Exception)


@pytest.mark.parametrize("version, sent", [("0.3.64", 0.0), ("0.30.9", 0.0), ("0.31.0", 1.0), ("0.33.0", 1.0)])
def test_ltx2_model_calls_ask_for_the_block_order_of_this_comfyui(monkeypatch, version, sent):
    """LTXAV's block order changed in ComfyUI 0.31.0 (PR 15138): its model calls ask the pool for the order of the
    ComfyUI they run in, 1 from that version on, 0 before (LTX-2's declaration, ComfyData.model_call_versions)."""
    from parallel.families.ltx2.pipelines import xFuserLTX2Pipeline

    stand_in = types.ModuleType("comfyui_version")
    stand_in.__version__ = version
    compat = import_node_module(monkeypatch, "comfy_compat", {"comfyui_version": stand_in})
    flags = compat.model_call_versions(xFuserLTX2Pipeline.comfy.model_call_versions, 1)
    assert {name: value.tolist() for name, value in flags.items()} == {"v2a_reads_updated_video": [sent]}
    assert compat.model_call_versions({}, 1) == {}
