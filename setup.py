"""Maps the repository's top-level folders onto the single import root `kvmesh`.

frontend/ -> kvmesh.frontend, router/ -> kvmesh.router, workers/ -> kvmesh.workers,
planner/ -> kvmesh.planner, gen/kvmesh/api/ -> kvmesh.api (generated), kvmesh/ -> kvmesh.
Metadata lives in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "kvmesh": "kvmesh",
    "kvmesh.frontend": "frontend",
    "kvmesh.router": "router",
    "kvmesh.workers": "workers",
    "kvmesh.planner": "planner",
    "kvmesh.api": "gen/kvmesh/api",
}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        base = Path(folder)
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base).parts
            found.append(".".join((name, *rel)))
    return found


if (
    __name__ == "__main__"
):  # setuptools runs this file as __main__; tests/typecheck.py imports ROOTS
    setup(
        package_dir=ROOTS,
        packages=packages(),
        package_data={"kvmesh.api": ["py.typed", "**/*.pyi"]},
    )
