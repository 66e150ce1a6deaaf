"""Build hook (hatchling): compiles kvmesh's one C extension, `kvmesh.runtime._otlpc` (the OTLP
span encoder, runtime/kvmesh/runtime/_otlpc.c), with the C compiler Python was built with.

- `pip install -e .`: built in place, next to its source (git ignores it).
- A wheel: built in a temporary folder and added to the wheel, which is then platform-specific.

Optional: without a compiler or Python's headers the build goes on (a warning says so) and
kvmesh encodes spans in Python (kvmesh.runtime.otlp), slower but the same bytes.
KVMESH_BUILD_EXTENSION=0 skips it: a pure-Python wheel, for any Python. (The container images
build their wheel on the engine's own base image, with its Python: deploy/container/Dockerfile.)
The extension carries the SHA-256 of the source it was built from; kvmesh.runtime.otlp does not
load one built from another version of the source (an editable checkout edited since its
install).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("runtime/kvmesh/runtime/_otlpc.c")
MODULE = "kvmesh/runtime/_otlpc"


def compile_extension(source: Path, out: Path) -> None:
    """Compile `source` into the extension module `out` (raises CalledProcessError/OSError)."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    command = [
        *cc,
        "-shared",
        "-fPIC",
        "-O2",
        "-std=c11",
        "-Wall",
        f"-I{sysconfig.get_paths()['include']}",
        f'-DKVMESH_OTLPC_SOURCE="{digest}"',
        str(source),
        "-o",
        str(out),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if os.environ.get("KVMESH_BUILD_EXTENSION", "").strip() == "0":
            return
        root = Path(self.root)
        source = root / SOURCE
        name = MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        if version == "editable":
            out = root / "runtime" / name
        else:
            out = Path(tempfile.mkdtemp(prefix="kvmesh-build-")) / Path(name).name
        try:
            compile_extension(source, out)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            print(
                f"kvmesh: the C span encoder was not built ({detail.strip()[:2000]}); "
                "spans will be encoded in Python (slower, same output)",
                file=sys.stderr,
            )
            return
        if version != "editable":
            build_data["force_include"][os.fspath(out)] = name
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
