"""JupyterLab on the repository (chapters/ and exercises/ side by side): the one command line
that ``make lab`` and its test share.

Containers and cloud notebooks often run as root, where jupyter refuses to start unless
given --allow-root; we pass it only then, so everyone else keeps jupyter's guard. Such
machines have no browser either: --no-browser, and jupyter prints the URL with its token.

``make lab`` runs this file as a script (``python minillm/course/jupyter.py``), not as
``python -m minillm.bench``: it needs only the standard library, so a half-finished edit
of the engine, or a slow torch import, never stands between a learner and the notebooks.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def is_root() -> bool:
    """True when the effective uid is 0 (never on Windows, which has no uids)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_command(port: int = 8888, ip: str = "127.0.0.1", root_dir: str = ".") -> list[str]:
    """The argv that starts JupyterLab headless on ip:port, serving root_dir."""
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ip={ip}", f"--port={port}",
           f"--ServerApp.root_dir={os.path.abspath(root_dir)}"]
    if is_root():
        cmd.append("--allow-root")
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python minillm/course/jupyter.py",
                                description="Start JupyterLab on the repository (chapters/, exercises/), without opening a browser. "
                                            "Open the printed URL (it carries the login token).",
                                epilog="other options are passed to jupyter lab unchanged")
    p.add_argument("--port", type=int, default=8888, help="port to listen on (default 8888; the next free one if taken)")
    p.add_argument("--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--root-dir", default=".", help="folder JupyterLab shows (default: the repository, so that chapters/ and exercises/ both open)")
    args, extra = p.parse_known_args(argv)
    cmd = lab_command(args.port, args.ip, args.root_dir) + extra
    sys.stdout.flush()
    if os.name == "posix":
        os.execv(cmd[0], cmd)  # jupyter takes over this process: Ctrl-C and signals reach it directly
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
