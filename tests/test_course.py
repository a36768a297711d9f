"""`make lab` starts JupyterLab on chapters/, also as root (containers, cloud notebooks).

Jupyter refuses to run as root without --allow-root, and such machines have no browser:
the test runs the real `make lab` (as whichever user runs the tests; root here covers the
bug), reads the URL it prints the way a user would, and lists the chapters over HTTP.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 90  # JupyterLab imports a lot: generous for a busy 2-core CPU


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment without anything that would change what jupyter does or where it writes."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE")}
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR"):   # no user config (passwords, ports), no stray files
        (tmp_path / name).mkdir()
        env[name] = str(tmp_path / name)
    # The port is the one we checked is free: fail fast if it is taken rather than move to another.
    (tmp_path / "JUPYTER_CONFIG_DIR" / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"port_retries": 0}}))
    return env


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through an http_proxy


def get(url: str, token: str, timeout: float = 10.0):
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with DIRECT.open(req, timeout=timeout) as r:
        return r.status, r.read()


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to make and the jupyter it started (one process group), SIGKILL if they outstay grace_s."""
    pgid, deadline = proc.pid, time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break                                   # every process of the group is gone
        proc.poll()                                 # reap make, or the group never empties
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        else:
            sig = 0                                 # only ask whether the group still exists
        time.sleep(0.2)
    proc.wait(timeout=10)


def load_lab_module():
    """minillm/course/jupyter.py loaded by path, as `make lab` runs it: without importing the minillm package."""
    spec = importlib.util.spec_from_file_location("minillm_lab", ROOT / "minillm" / "course" / "jupyter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lab_command_allows_root_only_for_root(monkeypatch):
    lab = load_lab_module()
    for uid, expected in ((0, True), (1000, False)):
        monkeypatch.setattr(os, "geteuid", lambda uid=uid: uid, raising=False)
        cmd = lab.lab_command(port=8765, ip="127.0.0.1", root_dir=str(ROOT / "chapters"))
        assert ("--allow-root" in cmd) is expected, cmd
        assert cmd[:3] == [sys.executable, "-m", "jupyterlab"], cmd
        for arg in ("--no-browser", "--ip=127.0.0.1", "--port=8765", f"--ServerApp.root_dir={ROOT / 'chapters'}"):
            assert arg in cmd, (arg, cmd)


@pytest.mark.skipif(shutil.which("make") is None, reason="`make lab` needs make")
def test_make_lab_serves_the_chapters(tmp_path):
    port = free_loopback_port()
    log_path = tmp_path / "lab.log"
    # -o setup: use the environment this test runs in; never (re)install from a test.
    cmd = ["make", "--no-print-directory", "-o", "setup", "lab",
           f"PY={sys.executable}", f"LAB_PORT={port}", "LAB_IP=127.0.0.1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=make_env(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = re.compile(rf"http://127\.0\.0\.1:{port}/lab\?token=([0-9a-f]+)")
        deadline, token = time.monotonic() + STARTUP_S, None
        while token is None:
            m = url.search(log_path.read_text(errors="replace"))
            if m:
                token = m.group(1)
            elif proc.poll() is not None:
                pytest.fail(f"`make lab` exited ({proc.returncode}) before printing its URL:\n"
                            + log_path.read_text(errors="replace")[-3000:])
            elif time.monotonic() > deadline:
                pytest.fail(f"no URL with a token after {STARTUP_S} s:\n" + log_path.read_text(errors="replace")[-3000:])
            else:
                time.sleep(0.5)

        base = f"http://127.0.0.1:{port}"
        status, body = get(f"{base}/api/contents/?content=1", token)
        assert status == 200
        top = {item["name"] for item in json.loads(body)["content"]}
        assert {"chapters", "exercises"} <= top, top  # a chapter and the exercise file it names both open
        status, body = get(f"{base}/api/contents/chapters?content=1", token)
        assert status == 200
        names = {item["name"] for item in json.loads(body)["content"]}
        chapters = {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
        assert "00_the_model.ipynb" in chapters and chapters <= names, (chapters, names)
        status, page = get(f"{base}/lab?token={token}", token)
        assert status == 200 and b"JupyterLab" in page       # the Lab UI, not only the contents API
        with pytest.raises(urllib.error.HTTPError) as e:     # and the token is really required
            get(f"{base}/api/contents/", "not-the-token")
        assert e.value.code == 403
    finally:
        stop_group(proc)
