"""Shared fixtures: tiny pipelines saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel.loading import tiny_models


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_models.save_tiny_pipeline(family, root / family) for family in tiny_models.FAMILIES}


@pytest.fixture(scope="session")
def video_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video_models")
    return {family: tiny_models.save_tiny_pipeline(family, root / family) for family in tiny_models.VIDEO_FAMILIES}


@pytest.fixture(scope="session")
def z_image_file(tmp_path_factory) -> Path:
    """The smallest Z-Image ComfyUI detects (3.6 GB, tests/large_files.py), built once per run for every test."""
    from large_files import write_z_image

    return write_z_image(tmp_path_factory.mktemp("large_files") / "z-image-one-layer.safetensors")


@pytest.fixture(scope="session")
def qwen_image_files(tmp_path_factory) -> Path:
    """The one-block Qwen-Image of ComfyUI's width (1.5 GB, tests/large_files.py), built once per run for every
    module that links it into its server's models folders (test_comfyui_model's qwen_checkpoint)."""
    from large_files import write_qwen_image

    return write_qwen_image(tmp_path_factory.mktemp("qwen_image"))


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def comfyui_install() -> tuple[Path, Path]:
    """(ComfyUI folder, its python) from the test bed; without one, every ComfyUI test skips here, so
    `pytest -rs` prints one line saying how to enable them."""
    import testbed

    found = testbed.comfyui()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="session")
def comfyui_oldest_install() -> tuple[Path, Path]:
    """(ComfyUI folder, its python) of the oldest supported ComfyUI (0.3.64), for the compatibility leg
    (tests/test_comfyui_oldest.py); skipped, as comfyui_install is, with the reason when there is none."""
    import testbed

    found = testbed.comfyui(testbed.OLDEST)
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """ComfyUI tests skipped by their fixtures (no test bed, no browser) fold into one `-rs` line per
    reason, here, instead of one line per test."""
    report = yield
    installs = ("comfyui_install", "comfyui_oldest_install")
    if report.skipped and report.when == "setup" and any(name in item.fixturenames for name in installs):
        report.longrepr = (__file__, None, report.longrepr[2])
    return report


@pytest.fixture(scope="module")
def comfy(request, comfyui_install, tmp_path_factory):
    """A real ComfyUI server with this pack, one per test module that asks for it (with the module's COMFY_ARGS)."""
    from comfyui_server import ComfyServer

    server = ComfyServer(*comfyui_install, tmp_path_factory.mktemp("comfy"), getattr(request.module, "COMFY_ARGS", ()))
    yield server
    server.stop()
    assert "IMPORT FAILED" not in server.log.read_text()


@pytest.fixture(scope="module")
def page(request):
    """A headless Chromium page on the module's ComfyUI server (`comfy`, or the fixture its PAGE_SERVER names);
    without Node.js, playwright-core or Chromium the test skips with the reason."""
    from comfyui_page import open_page

    browser = open_page(request.getfixturevalue(getattr(request.module, "PAGE_SERVER", "comfy")))
    if isinstance(browser, str):
        pytest.skip(browser)
    yield browser
    browser.close()
