"""Regenerate gen/ from protos/: Python messages, gRPC stubs and typed .pyi stubs.

Run: python protos/generate.py            (writes gen/)
     python protos/generate.py --check    (fails if gen/ is out of date; CI runs this)

The generator versions are pinned here and in pyproject's `dev` extra; the script refuses to
run with any other version so that everyone produces byte-identical output.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import shutil
import sys
import tempfile
from pathlib import Path

PINS = {"grpcio-tools": "1.81.1", "mypy-protobuf": "5.1.0"}
ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GEN = ROOT / "gen"


def check_pins() -> None:
    bad = []
    for dist, want in PINS.items():
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if have != want:
            bad.append(f"{dist}=={want} (found {have})")
    if bad:
        sys.exit(
            "protos/generate.py needs " + ", ".join(bad) + "; install with pip install -e '.[dev]'"
        )


def _mypy_protobuf_plugins() -> dict[str, Path]:
    """The protoc plugin executables mypy-protobuf installed, wherever its environment put them
    (this venv's bin/, or a base environment's for a venv with system site-packages)."""
    dist = importlib.metadata.distribution("mypy-protobuf")
    found = {
        Path(str(f)).name: Path(str(dist.locate_file(f))).resolve()
        for f in dist.files or ()
        if Path(str(f)).name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc")
    }
    if len(found) != 2:
        sys.exit("protos/generate.py: mypy-protobuf's protoc plugins are not installed")
    return found


def generate(out: Path) -> None:
    from grpc_tools import protoc  # imported late: only needed when generating

    plugins = _mypy_protobuf_plugins()
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={plugins['protoc-gen-mypy']}",
        f"--plugin=protoc-gen-mypy_grpc={plugins['protoc-gen-mypy_grpc']}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    # Every generated directory is a regular package so setuptools and mypy find it.
    for d in [p for p in (out / "kvmesh" / "api").rglob("*") if p.is_dir()] + [
        out / "kvmesh" / "api"
    ]:
        (d / "__init__.py").touch()
    (out / "kvmesh" / "api" / "py.typed").write_text("")


def same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    stack = [cmp]
    while stack:
        c = stack.pop()
        if c.left_only or c.right_only or c.diff_files or c.funny_files:
            return False
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        if mismatch or errors:
            return False
        stack.extend(c.subdirs.values())
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if gen/ differs from protos/")
    args = parser.parse_args()
    check_pins()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gen"
        out.mkdir()
        generate(out)
        for junk in out.rglob("__pycache__"):
            shutil.rmtree(junk)
        if args.check:
            live = Path(tmp) / "live"
            shutil.copytree(GEN, live, ignore=shutil.ignore_patterns("__pycache__"))
            if not same_tree(out, live):
                sys.exit("gen/ is out of date: run python protos/generate.py and commit the result")
            print("gen/ is in sync with protos/")
            return
        shutil.rmtree(GEN, ignore_errors=True)
        shutil.copytree(out, GEN)
    print(f"generated {GEN}")


if __name__ == "__main__":
    main()
