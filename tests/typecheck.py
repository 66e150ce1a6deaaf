"""Run mypy over the `kvmesh` import root as it is installed.

The repository maps several top-level folders onto one import root (see setup.py), which mypy
cannot see through an editable install's import hook. This builds a tree of symlinks with the
installed layout under .cache/typecheck and runs mypy on it.
Usage: python tests/typecheck.py [mypy args...]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from setup import ROOTS  # noqa: E402  (the one mapping, shared with packaging)


def build(tree: Path) -> Path:
    shutil.rmtree(tree, ignore_errors=True)
    pkg = tree / "kvmesh"
    pkg.mkdir(parents=True)
    for entry in (ROOT / ROOTS["kvmesh"]).iterdir():
        if entry.suffix == ".py":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in ROOTS.items():
        if name != "kvmesh":
            (pkg / name.split(".", 1)[1]).symlink_to(ROOT / folder, target_is_directory=True)
    return tree


def main() -> int:
    tree = build(ROOT / ".cache" / "typecheck")
    env = {**os.environ, "MYPYPATH": str(tree)}
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "-p",
        "kvmesh",
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
