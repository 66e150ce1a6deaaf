"""The `kvmesh` command: up, frontend, router, worker, planner, model, bench, replay, reshape,
profile, workload.

Parsing happens in main() only. Each process (up, frontend, router, worker) has one entry point
in its component (`ENTRY`: its name, the config dataclasses its flags come from, and the function
that builds its object graph from them); the other commands are tools. Global flags
(GlobalConfig: --log-level) are accepted before and after the command's name.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvmesh.runtime import __version__
from kvmesh.runtime.config import ConfigError, Flags, add_args, from_args
from kvmesh.runtime.errors import KvmeshError
from kvmesh.runtime.process import Entry, GlobalConfig, run, setup_logging

if TYPE_CHECKING:
    from kvmesh.sim.config import ReplayConfig


def _processes() -> list[Entry]:
    """The processes `kvmesh` runs, one entry point each, in its component."""
    from kvmesh.apps import up
    from kvmesh.frontend import main as frontend
    from kvmesh.planner import main as planner
    from kvmesh.router import main as router
    from kvmesh.workers import main as worker

    return [up.ENTRY, frontend.ENTRY, router.ENTRY, worker.ENTRY, planner.ENTRY]


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


def replay_config(ns: argparse.Namespace) -> ReplayConfig:
    """`kvmesh replay`'s settings from its parsed flags."""
    from kvmesh.planner.config import PlannerConfig
    from kvmesh.router.backend import DisaggConfig
    from kvmesh.sim.config import ReplayConfig
    from kvmesh.workers.batching.tiers import KvTierConfig
    from kvmesh.workers.mocker.config import MockerConfig

    mocker = from_args(MockerConfig, ns)
    disagg = from_args(DisaggConfig, ns)
    planning = from_args(PlannerConfig, ns)
    tiers = from_args(KvTierConfig, ns)
    return from_args(ReplayConfig, ns, mocker=mocker, disagg=disagg, planning=planning, tiers=tiers)


def _cmd_replay(ns: argparse.Namespace) -> int:
    from kvmesh.sim.main import run_replay

    return run_replay(replay_config(ns))


def _cmd_profile(ns: argparse.Namespace) -> int:
    from kvmesh.apps.profile import run_profile

    return run_profile(ns)


def _cmd_reshape(ns: argparse.Namespace) -> int:
    from kvmesh.sim.reshape import ReshapeConfig, run_reshape

    return run_reshape(from_args(ReshapeConfig, ns))


def _cmd_workload(ns: argparse.Namespace) -> int:
    from kvmesh.sim.workloads import run_workload

    return run_workload(ns)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (built on demand, never at import time)."""
    from kvmesh.apps.bench import BenchConfig
    from kvmesh.sim.config import add_replay_args
    from kvmesh.sim.reshape import ReshapeConfig
    from kvmesh.sim.workloads import WorkloadConfig

    parser = argparse.ArgumentParser(prog="kvmesh", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    common = Flags.of(GlobalConfig)
    common.add_to(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, help: str, fn: Callable[[argparse.Namespace], int | None]
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        common.add_to(p)
        return p

    for entry in _processes():
        entry.flags.add_to(command(entry.name, entry.help, entry.main))

    model = command("model", "manage local models", lambda ns: model.print_help())
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    create = msub.add_parser(
        "create", help="build the tiny offline model (tokenizer, chat template, random weights)"
    )
    common.add_to(create)
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

    from kvmesh.apps.profile import flags as profile_flags

    profile_flags().add_to(
        command(
            "profile",
            "measure an engine's performance profile (for the SLA planner)",
            _cmd_profile,
        )
    )

    reshape = command(
        "reshape", "re-time a trace's requests into a day (low -> peak -> low)", _cmd_reshape
    )
    add_args(reshape, ReshapeConfig)

    workload = command(
        "workload",
        "write a generated trace with known prefix sharing (Mooncake JSONL) for kvmesh replay",
        _cmd_workload,
    )
    add_args(workload, WorkloadConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `kvmesh` console script."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    setup_logging(from_args(GlobalConfig, ns))
    try:
        code = ns.fn(ns)
    except (KvmeshError, ConfigError) as exc:
        message = exc.message if isinstance(exc, KvmeshError) else str(exc)
        print(f"kvmesh {ns.command}: error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code or 0)
