"""The ComfyUI test beds: real ComfyUIs, each in its own venv with this pack's requirements, and Chromium with
playwright-core for the browser tests. ComfyUI is not on the package registries, so each bed is built from a
source snapshot in ../shared/comfyui/ (beside the repository) into the cache, once, and reused.

Two versions are tested: CURRENT (0.33.0), against which every ComfyUI and browser test runs, and OLDEST
(0.3.64), the oldest version the pack supports, in a short compatibility leg (tests/test_comfyui_oldest.py).

`python tests/testbed.py` builds whatever is missing (scripts/test.sh runs it before pytest); the tests
only look things up here (`comfyui()`, `browser()`) and skip with the reason these give when there is
nothing to find. COMFYUI_PATH / COMFYUI_PYTHON point the main tests at a ComfyUI of your own instead
(COMFYUI_OLDEST_PATH / COMFYUI_OLDEST_PYTHON the compatibility leg); XDIT_CHROMIUM / XDIT_PLAYWRIGHT_DIR at
your own browser and driver.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT.parent / "shared" / "comfyui"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "comfyui-xdit-pool"
TORCH = "torch==2.13.0"  # as scripts/bootstrap.sh pins it; the CPU wheel lies on this machine's disk
# Only CUDA-linked wheels exist of these; both run on the CPU torch after the patches in _patch_torch_extras.
TORCHVISION, TORCHAUDIO = "torchvision==0.28.0", "torchaudio==2.11.0"
PLAYWRIGHT = "playwright-core@1.65.1"
CHROMIUM = Path(os.environ.get("XDIT_CHROMIUM", "/usr/bin/chromium"))
NODE_MODULES = Path(os.environ.get("XDIT_PLAYWRIGHT_DIR", CACHE / "node" / "node_modules"))
ENABLE = ("put the ComfyUI snapshot in ../shared/comfyui/ beside the repository (or set COMFYUI_PATH and "
          "COMFYUI_PYTHON to a ComfyUI of your own), then run `bash scripts/test.sh`")


CURRENT, OLDEST = "0.33.0", "0.3.64"
OVERRIDE = {CURRENT: ("COMFYUI_PATH", "COMFYUI_PYTHON"), OLDEST: ("COMFYUI_OLDEST_PATH", "COMFYUI_OLDEST_PYTHON")}


def snapshot(version: str = CURRENT) -> Path | None:
    """The source tarball of that ComfyUI version in ../shared/comfyui/, if there is one."""
    return next(iter(sorted(SNAPSHOT.glob(f"ComfyUI-{version}-*.tar.gz"))), None)


def bed_dir(tarball: Path) -> Path:
    """Keyed on the snapshot's content, so a new snapshot gets a new bed."""
    return CACHE / f"testbed-{hashlib.sha256(tarball.read_bytes()).hexdigest()[:16]}"


def comfyui(version: str = CURRENT) -> tuple[Path, Path] | str:
    """(ComfyUI folder, its python) of that version for the tests, else the one-line reason they are skipped."""
    path_var, python_var = OVERRIDE[version]
    if os.environ.get(path_var):
        comfy = Path(os.environ[path_var])
        python = Path(os.environ.get(python_var) or shutil.which("python3") or "python3")
        if not (comfy / "main.py").is_file() or not python.is_file():
            return f"{path_var}={comfy} has no main.py or {python_var}={python} does not exist: fix them, or unset both"
        return comfy, python
    tarball = snapshot(version)
    if tarball is None:
        return (f"ComfyUI {version} tests skipped: no ComfyUI-{version}-*.tar.gz in {SNAPSHOT} and no {path_var}; "
                f"to run them, {ENABLE}")
    bed = bed_dir(tarball)
    if not (bed / "complete").is_file():
        return f"ComfyUI tests skipped: the test bed {bed} is not built; run `python tests/testbed.py` (scripts/test.sh does)"
    return bed / "ComfyUI", bed / "venv" / "bin" / "python"


def browser() -> tuple[str, Path, Path] | str:
    """(node, the node_modules folder holding playwright-core, Chromium) for the browser tests, else why not."""
    node = shutil.which("node")
    if node is None:
        return "browser tests skipped: no Node.js; run `python tests/testbed.py` as root (it apt-installs nodejs)"
    if not (NODE_MODULES / "playwright-core" / "package.json").is_file():
        return f"browser tests skipped: no playwright-core in {NODE_MODULES}; run `python tests/testbed.py`"
    if not CHROMIUM.is_file():
        return f"browser tests skipped: no Chromium at {CHROMIUM}; run `python tests/testbed.py` as root, or set XDIT_CHROMIUM"
    return node, NODE_MODULES, CHROMIUM


@contextmanager
def step(what: str):
    """One line per build step: what it does, then how long it took."""
    start = time.monotonic()
    print(f"testbed: {what} ...", end="", flush=True)
    yield
    print(f" {time.monotonic() - start:.0f} s", flush=True)


def run(*command, **kwargs) -> None:
    """A build command, quiet unless it fails (then its output ends the build)."""
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if result.returncode:
        sys.exit(f"\nerror: `{' '.join(map(str, command))}` failed (rc {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")


def pip(python: Path, constraints: Path, *args) -> None:
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", constraints, *args)


def build_bed(tarball: Path, bed: Path) -> None:
    """Everything is built in place and `complete` is written last: a bed without it is half-built and
    is removed and rebuilt."""
    if bed.exists():
        shutil.rmtree(bed)
    comfy, venv = bed / "ComfyUI", bed / "venv"
    with step(f"extract {tarball.name} into {bed}"):
        comfy.mkdir(parents=True)
        with tarfile.open(tarball) as archive:
            archive.extractall(comfy, filter="data")
    python, constraints = venv / "bin" / "python", bed / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    with step(f"ComfyUI's venv: {TORCH}"):
        run(sys.executable, "-m", "venv", venv)
        pip(python, constraints, TORCH)
    with step("ComfyUI's requirements (without torch, torchvision, torchaudio; with requests)"):
        wanted = [line for line in (comfy / "requirements.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#")
                  and re.split(r"[<>=~ ]", line.strip())[0] not in ("torch", "torchvision", "torchaudio")]
        (bed / "comfyui-requirements.txt").write_text("\n".join(wanted + ["requests"]) + "\n")
        pip(python, constraints, "-r", bed / "comfyui-requirements.txt")
    with step(f"{TORCHVISION} and {TORCHAUDIO} for the CPU torch"):
        pip(python, constraints, "--no-deps", TORCHVISION, TORCHAUDIO)
        _patch_torch_extras(python)
    with step("this pack's requirements.txt, as ComfyUI Manager installs them"):
        pip(python, constraints, "-r", ROOT / "requirements.txt")
        (bed / "pack-requirements.sha256").write_text(_requirements_hash())
    with step("ComfyUI starts (--quick-test-for-ci)"):
        run(python, "main.py", "--cpu", "--quick-test-for-ci", "--database-url", "sqlite:///:memory:",
            cwd=comfy, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (bed / "complete").write_text(f"{tarball.name}\n")


def _patch_torch_extras(python: Path) -> None:
    """torchvision's C ops are CUDA-linked and do not load: its import then dies registering fake kernels
    for nms/qnms, so those registrations are guarded (transforms work; torchvision.ops/io do not, and
    ComfyUI does not need them). torchaudio without its native libraries runs as pure Python."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    meta = site / "torchvision" / "_meta_registrations.py"
    source = meta.read_text()
    patched = re.sub(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)\n',
                     r'@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))\n',
                     source, flags=re.M)
    if patched.count("_has_ops()") < 2:
        sys.exit(f"error: {meta} no longer has the nms/qnms registrations the test bed patches; update _patch_torch_extras")
    meta.write_text(patched)
    for library in (site / "torchaudio" / "lib").glob("*.so"):
        library.unlink()
    run(python, "-c", "import torchvision.transforms.functional, torchaudio")


def _requirements_hash() -> str:
    return hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()


def refresh_pack_requirements(python: Path, stamp: Path) -> None:
    """Reinstall the pack's requirements into ComfyUI's python when requirements.txt has changed."""
    if stamp.is_file() and stamp.read_text() == _requirements_hash():
        return
    with step("this pack's requirements.txt changed: installing it into ComfyUI's python"):
        version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__.split('+')[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        stamp.parent.mkdir(parents=True, exist_ok=True)
        constraints = stamp.with_suffix(".constraints.txt")
        constraints.write_text(f"torch=={version}\n")  # never replace the torch ComfyUI has
        pip(python, constraints, "-r", ROOT / "requirements.txt")
        stamp.write_text(_requirements_hash())


def build_browser() -> None:
    """Chromium (and Node.js) from the system package manager, playwright-core from the npm registry."""
    packages = [name for name, missing in (("chromium", not CHROMIUM.is_file()),
                                           ("nodejs npm", shutil.which("node") is None)) if missing]
    if packages:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            print(f"testbed: cannot install {' '.join(packages)} (needs root and apt-get): the browser tests will skip")
            return
        with step(f"apt-get install {' '.join(packages)}"):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            run("apt-get", "update", "-qq", env=env)
            run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *" ".join(packages).split(), env=env)
    stamp = NODE_MODULES.parent / f"complete-{PLAYWRIGHT}"
    if stamp.is_file():
        print(f"testbed: reusing {CHROMIUM} and {PLAYWRIGHT} in {NODE_MODULES}")
    else:
        with step(f"npm install {PLAYWRIGHT} into {NODE_MODULES.parent}"):
            NODE_MODULES.parent.mkdir(parents=True, exist_ok=True)
            run("npm", "install", "--prefix", NODE_MODULES.parent, "--no-audit", "--no-fund", "--no-save", PLAYWRIGHT)
            stamp.write_text("")


def ensure_bed(version: str) -> None:
    """The test bed of one ComfyUI version: the user's own, a reused one, or one built now."""
    found = comfyui(version)
    path_var = OVERRIDE[version][0]
    if os.environ.get(path_var):
        if isinstance(found, str):
            sys.exit(f"error: {found}")
        comfy, python = found
        print(f"testbed: ComfyUI {version} from {path_var}: {comfy}")
        refresh_pack_requirements(python, CACHE / f"pack-requirements-{hashlib.sha256(bytes(python)).hexdigest()[:16]}")
    elif (tarball := snapshot(version)) is None:
        print(f"testbed: no ComfyUI-{version}-*.tar.gz in {SNAPSHOT}: its tests will skip; to run them, {ENABLE}")
    else:
        bed = bed_dir(tarball)
        if isinstance(found, str):
            build_bed(tarball, bed)
        else:
            print(f"testbed: reusing {bed} (ComfyUI {version})")
            refresh_pack_requirements(found[1], bed / "pack-requirements.sha256")


def main() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run building the same cache waits, then reuses it
        for version in (CURRENT, OLDEST):
            ensure_bed(version)
        build_browser()


if __name__ == "__main__":
    main()
