"""`pip install --no-build-isolation .` into a new virtualenv that has only torch gives a
working package: `from vllm import LLM` imports and `vllm serve` answers `/v1/models`.

What a stranger does after installing the CPU torch. It fails when setup.py declares no
dependency (the package installs, then its first import needs transformers).

The virtualenv gets the host's torch 2.13.0 and torch's own dependencies by symlinks into its
site-packages (with their dist-info, so pip sees torch installed, as after
`pip install torch==2.13.0`, without copying 700 MB; the dist-info without RECORD, so pip
could never uninstall through a link); everything else comes from pip, through
its cache and the machine's configured indexes/`--find-links`. The repository is copied (its
tracked and unignored files) so the build leaves nothing in the checkout; the copy, the
virtualenv and the server are removed at the end. The C++ kernels are not built here
(VLLM_PP_SKIP_KERNELS=1): the dependencies are what this test is about, and the kernel build
is checked by `make install` under VLLM_PP_REQUIRE_KERNELS=1 in CI (test_kernels_loaded.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import httpx
import pytest

from vllm.distributed.net_utils import get_open_port

REPO = pathlib.Path(__file__).resolve().parents[2]
TORCH_VERSION = "2.13.0"
PIP_TIMEOUT_S = 600
SERVE_TIMEOUT_S = 180
IMPORT_ALL = """
from vllm import LLM
import importlib, pathlib, vllm
root = pathlib.Path(vllm.__file__).parent
for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    importlib.import_module(".".join(parts))
print(vllm.__file__)
"""


def _repo_files() -> list[str]:
    """The checkout's files as a clone would have them (tracked, plus new unignored ones)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


def _copy_repo(dest: pathlib.Path) -> None:
    for name in _repo_files():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def _distribution_closure(name: str) -> list[importlib.metadata.Distribution]:
    """`name`'s installed distribution and, recursively, those it requires (no extras)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        wanted = todo.pop()
        key = re.sub(r"[-_.]+", "-", wanted).lower()
        if key in seen:
            continue
        dist = importlib.metadata.distribution(wanted)
        seen[key] = dist
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                todo.append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    return list(seen.values())


def _link_torch(site_packages: pathlib.Path) -> None:
    """Symlink the host's torch and its dependencies (their top-level entries; the dist-info
    copied) into the venv, leaving alone what the venv already has (pip, setuptools)."""
    version = importlib.metadata.version("torch")
    assert version.split("+")[0] == TORCH_VERSION, f"the host's torch is {version}"
    host_site = pathlib.Path(sysconfig.get_paths()["purelib"])
    present = {p.name.split("-")[0].lower() for p in site_packages.glob("*.dist-info")}
    for dist in _distribution_closure("torch"):
        if re.sub(r"[-.]+", "_", dist.metadata["Name"]).lower() in present:
            continue
        tops = {pathlib.PurePath(str(f)).parts[0] for f in dist.files or []}
        for top in sorted(tops):
            source = host_site / top
            # Entries outside site-packages (`../../bin/torchrun`) and caches are not linked.
            if top in ("..", "__pycache__") or not source.exists():
                continue
            target = site_packages / top
            if target.exists():
                continue
            if top.endswith(".dist-info"):
                # A copy without RECORD: pip then cannot uninstall the linked files (which
                # would delete the host's), it fails instead.
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("RECORD"))
            else:
                target.symlink_to(source)


def _clean_env() -> dict[str, str]:
    """This environment without what would let the venv import the checkout or the host's
    packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VLLM_PP_SKIP_KERNELS"] = "1"
    env.pop("VLLM_PP_REQUIRE_KERNELS", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], cwd: pathlib.Path, env: dict[str, str], timeout: float) -> str:
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )
    print(f"{time.monotonic() - started:6.1f} s  {' '.join(cmd[1:5])}")
    return result.stdout


@pytest.mark.slow  # a venv, pip installing the runtime dependencies, a server (~240 s, load 7)
def test_pip_install_into_a_venv_with_only_torch(tmp_path, tiny_model_dirs):
    source = tmp_path / "src"
    venv = tmp_path / "venv"
    elsewhere = tmp_path / "cwd"  # not the checkout: `import vllm` must find the installed one
    elsewhere.mkdir()
    env = _clean_env()
    server = None
    try:
        _copy_repo(source)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        python = str(venv / "bin" / "python")
        site_packages = pathlib.Path(
            _run(
                [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                elsewhere,
                env,
                60,
            ).strip()
        )
        _link_torch(site_packages)
        installed = _run([python, "-m", "pip", "list", "--format=freeze"], elsewhere, env, 120)
        assert f"torch=={TORCH_VERSION}" in installed and "transformers" not in installed

        # --no-build-isolation builds with the environment's own tools: a new venv has an
        # old setuptools without bdist_wheel (Python 3.11) or none (3.12+).
        # --no-compile: no .pyc written for every file of transformers, ray, pandas... at
        # install; the imports below compile only what they use.
        pip_install = [python, "-m", "pip", "install", "-q", "--no-compile"]
        _run([*pip_install, "setuptools>=70.1"], elsewhere, env, 300)
        _run(
            [*pip_install, "--no-build-isolation", str(source)],
            elsewhere,
            env,
            PIP_TIMEOUT_S,
        )
        after = _run([python, "-m", "pip", "list", "--format=freeze"], elsewhere, env, 120)
        assert f"torch=={TORCH_VERSION}" in after  # kept, not replaced by another build
        # `from vllm import LLM` is lazy (it imports no torch): every module of the installed
        # package is imported too, so a dependency missing anywhere fails here.
        where = _run([python, "-c", IMPORT_ALL], elsewhere, env, 600)
        assert where.strip().splitlines()[-1].startswith(str(site_packages)), where

        port = get_open_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                str(venv / "bin" / "vllm"),
                "serve",
                tiny_model_dirs["llama-gqa-tied"],
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--uvicorn-log-level",
                "warning",
            ],  # fmt: skip
            cwd=elsewhere,
            env=env,
        )
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        models = None
        while time.monotonic() < deadline:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}"
            try:
                models = httpx.get(url + "/v1/models", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert models is not None, f"vllm serve did not answer within {SERVE_TIMEOUT_S} s"
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(venv, ignore_errors=True)
