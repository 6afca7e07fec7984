"""`pip install slmviz` as a new user meets it: the wheel alone, in a fresh venv outside the checkout.

The slow test builds the wheel from this checkout, installs it into a fresh venv, and from an empty folder runs
`slmviz --version`, `slmviz trace` and `slmviz app`, which must answer on a port. The venv reads the
dependencies from this environment (a path entry to its site-packages, whose .pth files, the checkout's editable
install among them, are not run), and the wheel's own requirements are checked against the versions found there:
installing torch and ~150 packages again took a minute and a half of every CI run, for what `make test`'s own
install already proves. The bundled model is the one `make model` prepared (SLMVIZ_CACHE), so the test does not
spend a minute dequantizing it again.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

import slmviz

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_ships():
    """pyproject lists packages by hand (app/ is mapped to slmviz_app, app/tabs/ to slmviz_app.tabs); a new
    subpackage must be added there."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "slmviz").rglob("__init__.py")}
    app = {".".join(("slmviz_app", *p.parent.relative_to(REPO / "app").parts))
           for p in (REPO / "app").rglob("__init__.py")}
    assert set(config["packages"]) == folders | app
    assert config["package-dir"] == {"slmviz_app": "app"}


def test_version_is_one_string():
    assert re.fullmatch(r"\d+\.\d+\.\d+", slmviz.__version__)
    from slmviz.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


REQUIREMENTS_MET = """
import importlib.metadata as md
import json
from packaging.requirements import Requirement
unmet = []
for line in md.requires("slmviz") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        found = md.version(req.name)
    except md.PackageNotFoundError:
        found = None
    if found is None or not req.specifier.contains(found, prereleases=True):
        unmet.append(f"{line} (found {found})")
print(md.distribution("slmviz").locate_file(""))
print(json.dumps(unmet))
# where `import slmviz_app, slmviz` would load them from (found as the import finds them, without its seconds)
from importlib.util import find_spec
print(json.dumps([find_spec("slmviz_app").origin, find_spec("slmviz").origin]))
"""


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
         tmp_path, env)
    wheel = next(dist.glob("slmviz-*.whl"))
    assert slmviz.__version__ in wheel.name

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    site_packages = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              tmp_path, env).strip())
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", str(wheel)], tmp_path,
         env)
    where, unmet, code = _run([python, "-c", REQUIREMENTS_MET], tmp_path, env).strip().splitlines()
    assert str(site_packages) in where, f"slmviz's metadata was read from {where}, not from the wheel"
    assert json.loads(unmet) == [], f"the wheel's requirements are not met by this environment: {unmet}"
    # The app code that `slmviz app` serves below comes from the wheel, not from this checkout.
    assert all(str(REPO) not in path and str(venv) in path for path in json.loads(code)), code

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cli = str(venv / "bin" / "slmviz")
    assert _run([cli, "--version"], elsewhere, env).strip() == f"slmviz {slmviz.__version__}"
    assert "Paris" in _run([cli, "trace", "The capital of France is"], elsewhere, env)

    port = _free_port()
    server = subprocess.Popen([cli, "app", "--port", str(port)], cwd=elsewhere, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"slmviz app exited:\n{server.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    assert page.status == 200 and "slmviz" in page.read().decode("utf-8", "replace")
                    break
            except OSError:
                assert time.monotonic() < deadline, "slmviz app did not answer within 240 s"
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
