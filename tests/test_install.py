"""Packaging: a regular and an editable (PEP 660) install both put the start-up hook in site-packages, and the
build warns about no package or data folder."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOK = "pyserini_aligner.pth"
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", HOOK)


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """A copy of what a build reads, so that building leaves the checkout untouched."""
    tree = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(REPO / "pyserini_aligner", tree / "pyserini_aligner",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def _clean_env() -> dict:
    """The environment less PYTHONPATH, which would show the checkout's package as installed already."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=240, env={**_clean_env(), "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _bare_venv(path: Path) -> Path:
    """A virtualenv without pip or any package; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def _hook_installed(python: Path) -> bool:
    """Whether the interpreter put pyserini-aligner's import hook on sys.meta_path at start-up (no import of ours)."""
    code = "import sys; print(any(type(f).__module__ == 'pyserini_aligner._startup' for f in sys.meta_path))"
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60, env=_clean_env())
    assert result.returncode == 0, result.stderr
    return result.stdout.strip() == "True"


def test_wheel_carries_hook_and_data(source_tree, tmp_path):
    built = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), ".", cwd=source_tree)
    assert "would be ignored" not in built.stdout + built.stderr
    wheel = next((tmp_path / "dist").glob("pyserini_aligner-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert archive.read(HOOK) == (REPO / HOOK).read_bytes()
    assert {"pyserini_aligner/checkpoints/aligner/config.json", "pyserini_aligner/train/configs/aligner_default.yaml",
            "pyserini_aligner/search/__main__.py"} <= names
    assert not any("__pycache__" in name for name in names)
    python = _bare_venv(tmp_path / "venv")
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    assert _hook_installed(python)


def test_editable_install_carries_hook(source_tree, tmp_path):
    """The PEP 660 hook pip calls for ``pip install -e``, then the editable wheel installed by pip."""
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_editable(sys.argv[1]))", str(tmp_path / "dist")],
                           cwd=source_tree, capture_output=True, text=True, timeout=240, env=_clean_env())
    assert build.returncode == 0, build.stderr
    assert "would be ignored" not in build.stdout + build.stderr
    wheel = tmp_path / "dist" / build.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(HOOK) == (REPO / HOOK).read_bytes()
    python = _bare_venv(tmp_path / "venv")
    assert not _hook_installed(python)
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    assert _hook_installed(python)


def test_make_install_announces_each_step(tmp_path):
    """`make install` (minutes the first time) says what it is doing before each step, and the big pip installs show
    pip's own progress (no -q)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # not a sub-make
    done = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line and not line.startswith("#")]
    steps = [number for number, line in enumerate(lines) if line.startswith('echo "==> [')]
    assert len(steps) >= 4 and steps[0] == 0
    commands = [line for line in lines if not line.startswith("echo")]
    big = [line for line in commands if "pip install" in line and "--upgrade pip" not in line]
    assert len(big) == 2 and not any(" -q" in line for line in big), big
    for number, line in enumerate(lines):  # every command after the first step comes after an announcement
        if not line.startswith("echo") and not line.startswith("touch"):
            assert any(step < number for step in steps), line
    assert "warm_up" not in done.stdout  # make run compiles only the ranx kernels it uses, in its one process
    test = subprocess.run(["make", "-n", "test", f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)
    assert test.returncode == 0, test.stderr
    order = [line for line in test.stdout.splitlines() if "warm_up()" in line or "-m pytest" in line]
    assert len(order) == 2 and "warm_up()" in order[0], order  # compiled once before the test workers start
