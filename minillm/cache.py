"""The cache folder: where minillm keeps what it derives once and reuses (``MINILLM_CACHE``).

The loader's float32 weights, config and tokenizer; the CPU kernels' compiled library
(``kernels/cpu/build.py``); the model folder for vLLM. Entries arrive whole or not at all
(``write_atomically``, ``cached_folder``), and a cache that cannot be written costs only the
work again. Plain Python: nothing from minillm, no torch.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """``MINILLM_CACHE``, else ~/.cache/minillm (read at each call: a test may point it elsewhere)."""
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def write_atomically(target: Path, write) -> None:
    """``write(tmp)`` then rename to ``target`` (a file, or a folder): a crash never leaves
    half a cache entry, and of two processes writing at once one wins whole. A cache that
    cannot be written (read-only home) only costs the work again next time."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        tmp.replace(target)
    except OSError:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                tmp.unlink()
            except OSError:
                pass  # never written


FOLDER_MARK = "minillm-source.json"  # written last into a cache folder: the folder is complete


def cached_folder(folder: Path, write, source: str) -> bool:
    """Make sure the cache folder ``folder`` is complete, writing it if it is not.

    ``write(tmp)`` fills an empty folder under a temporary name; then ``FOLDER_MARK``
    (naming ``source``) goes in last and the folder is renamed into place, so a folder
    with the mark is whole, and of two processes writing at once one wins whole.
    ``write`` is called only when the folder is missing. Returns whether ``folder`` is
    complete now; False means the cache could not be written (a read-only home), and
    the caller does without it. A folder without the mark is a leftover and is replaced.
    """
    if (folder / FOLDER_MARK).is_file():
        return True
    if folder.is_dir():  # no mark: left half-written (folders only ever arrive whole, by rename)
        shutil.rmtree(folder, ignore_errors=True)

    def fill(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a process with this pid that died
        tmp.mkdir(parents=True)
        write(tmp)
        (tmp / FOLDER_MARK).write_text(json.dumps({"source": source}))

    write_atomically(folder, fill)
    return (folder / FOLDER_MARK).is_file()
