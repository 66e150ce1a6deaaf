"""The `kvmesh` command: up, frontend, router, worker, model, bench, replay.

Parsing happens in main() only; each subcommand builds its config dataclasses from the flags
and calls one function that wires the object graph explicitly.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from kvmesh.runtime import __version__
from kvmesh.runtime.config import add_args, from_args
from kvmesh.runtime.errors import KvmeshError
from kvmesh.runtime.process import run


def _cmd_worker(ns: argparse.Namespace) -> None:
    from kvmesh.workers.config import WorkerConfig
    from kvmesh.workers.main import serve_worker

    run(serve_worker(from_args(WorkerConfig, ns), ns))


def _cmd_frontend(ns: argparse.Namespace) -> None:
    from kvmesh.frontend.config import FrontendConfig
    from kvmesh.frontend.main import serve_frontend
    from kvmesh.router.stack import MeshConfig

    run(serve_frontend(from_args(FrontendConfig, ns), from_args(MeshConfig, ns)))


def _cmd_router(ns: argparse.Namespace) -> None:
    from kvmesh.router.main import RouterServerConfig, serve_router
    from kvmesh.router.stack import MeshConfig

    run(serve_router(from_args(RouterServerConfig, ns), from_args(MeshConfig, ns)))


def _cmd_up(ns: argparse.Namespace) -> None:
    from kvmesh.apps.up import UpConfig, run_up

    sys.exit(run_up(from_args(UpConfig, ns), ns))


def _cmd_model_create(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from kvmesh.runtime.modeldir import default_model_dir
    from kvmesh.runtime.tinymodel import create_tiny_model

    path = create_tiny_model(Path(ns.path) if ns.path else default_model_dir())
    if ns.weights:
        try:
            from kvmesh.workers.pytorch.weights import create_tiny_weights, has_weights
        except ImportError:
            print(
                "kvmesh model create: random weights need `pip install 'kvmesh[torch]'`; "
                "wrote the tokenizer and config only (enough for the mocker)",
                file=sys.stderr,
            )
        else:
            if not has_weights(path):
                create_tiny_weights(path)
    print(path)


def _cmd_bench(ns: argparse.Namespace) -> None:
    from kvmesh.apps.bench import BenchConfig, run_bench

    run(run_bench(from_args(BenchConfig, ns)))


def _cmd_replay(ns: argparse.Namespace) -> None:
    from kvmesh.router.backend import DisaggConfig
    from kvmesh.sim.config import ReplayConfig, ReplayError
    from kvmesh.sim.main import run_replay
    from kvmesh.workers.mocker.config import MockerConfig

    try:
        mocker = from_args(MockerConfig, ns)
        disagg = from_args(DisaggConfig, ns)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    sys.exit(run_replay(from_args(ReplayConfig, ns, mocker=mocker, disagg=disagg)))


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (built on demand, never at import time)."""
    from kvmesh.apps.bench import BenchConfig
    from kvmesh.apps.up import UpConfig
    from kvmesh.frontend.config import FrontendConfig
    from kvmesh.router.main import RouterServerConfig
    from kvmesh.router.stack import MeshConfig
    from kvmesh.sim.config import add_replay_args
    from kvmesh.workers.config import WorkerConfig
    from kvmesh.workers.main import engine_arg_groups

    parser = argparse.ArgumentParser(prog="kvmesh", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, help: str, fn: Callable[[argparse.Namespace], None]
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        return p

    up = command("up", "run frontend, router and N workers on this machine (no etcd)", _cmd_up)
    add_args(up, UpConfig)
    for group in engine_arg_groups():
        add_args(up, group)

    fe = command("frontend", "OpenAI HTTP gateway", _cmd_frontend)
    add_args(fe, FrontendConfig)
    add_args(fe, MeshConfig)

    rt = command("router", "standalone router gRPC service", _cmd_router)
    add_args(rt, RouterServerConfig)
    add_args(rt, MeshConfig, skip={"router_address"})

    wk = command("worker", "a worker process serving one engine", _cmd_worker)
    add_args(wk, WorkerConfig)
    for group in engine_arg_groups():
        add_args(wk, group)

    model = command("model", "manage local models", lambda ns: model.print_help())
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    create = msub.add_parser(
        "create", help="build the tiny offline model (tokenizer, chat template, random weights)"
    )
    create.add_argument("path", nargs="?", default="", help="target dir (default: the cache)")
    create.add_argument(
        "--weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also write random Llama weights (needs torch; the mocker needs none)",
    )
    create.set_defaults(fn=_cmd_model_create)

    bench = command("bench", "load-test an OpenAI endpoint (streaming chat)", _cmd_bench)
    add_args(bench, BenchConfig)

    replay = command(
        "replay",
        "offline virtual-time trace replay of the real router and mocker code",
        _cmd_replay,
    )
    add_replay_args(replay)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `kvmesh` console script."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        ns.fn(ns)
    except KvmeshError as exc:
        print(f"kvmesh {ns.command}: error: {exc.message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
