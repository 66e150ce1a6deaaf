"""The `kvmesh` command line: `kvmesh up` takes every flag of the processes it starts (but the
ones it sets itself) and hands the user's values to each child from the same config dataclasses;
global flags go before or after the command; one meaning per flag value; children of a process
with live gRPC threads start without fork."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmesh.apps.cli import build_parser
from kvmesh.apps.up import SET_BY_UP, Supervisor, UpArgs, UpConfig, cpu_share
from kvmesh.frontend.auth import API_KEY_ENV
from kvmesh.frontend.config import FrontendConfig
from kvmesh.router.main import RouterServerConfig
from kvmesh.router.stack import MeshConfig
from kvmesh.runtime.config import ConfigError, Flags, from_args, opt
from kvmesh.runtime.process import CORE_SLOT_ENV, GlobalConfig, LogLevel, core_slice
from kvmesh.runtime.types import Role
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.main import ENGINES
from kvmesh.workers.pytorch.config import TorchConfig

pytestmark = pytest.mark.unit

# Strings a config dataclass validates; every other flag gets a value derived from its type.
VALID_STRINGS = {
    "device": "cpu",
    "vllm_engine_args": '{"tensor_parallel_size": 2}',
    "sglang_engine_args": '{"tp_size": 2}',
    "trtllm_engine_args": '{"max_batch_size": 8}',
}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _field_default(classes: list[type[Any]], name: str) -> Any:
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return getattr(cls(), name)
    raise AssertionError(f"no config field {name}")


def _sample(action: argparse.Action, default: Any, model: Path) -> list[str]:
    """Flags that set `action`'s field to a valid value other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[0 if not default else 1]]
    if action.choices is not None:
        current = getattr(default, "value", default)
        return [f"{flag}={next(c for c in action.choices if c != current)}"]
    if action.nargs == "*":
        return [flag, "a=/x", "b=/y"]
    if action.dest == "model":
        return [f"{flag}={model}"]
    if action.type is int:
        return [f"{flag}={default + 7}"]
    if action.type is float:
        return [f"{flag}={default + 0.25}"]
    return [f"{flag}={VALID_STRINGS.get(action.dest, 'x-' + action.dest)}"]


def _flag_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.dest not in ("help", "log_level")]


def _configs(ns: argparse.Namespace, classes: list[type[Any]], skip: frozenset[str]) -> list[Any]:
    """The configs `classes` built from `ns`, as dicts without the fields in `skip`."""
    return [
        {k: v for k, v in dataclasses.asdict(from_args(c, ns)).items() if k not in skip}
        for c in classes
    ]


def _check_child(
    parser: argparse.ArgumentParser,
    command: str,
    classes: list[type[Any]],
    base: list[str],
    argv_of: Callable[[Supervisor], list[str]],
    model: Path,
    up_base: list[str],
) -> int:
    """Every flag of `kvmesh <command>` whose field is in `classes`: `kvmesh up` accepts it and
    the child's argv that up builds gives the child the same configs as the flag given to
    `kvmesh <command>` directly (`base`: flags given to both, `up_base`: to up only). Returns
    how many flags were checked."""
    child = _commands(parser)[command]
    skip = SET_BY_UP[command]
    fields = {f.name for c in classes for f in dataclasses.fields(c)}
    baseline = _configs(child.parse_args(base), classes, skip)
    checked = 0
    for action in _flag_actions(child):
        if action.dest in skip or action.dest not in fields or action.dest == "engine":
            continue
        args = base + _sample(action, _field_default(classes, action.dest), model)
        direct = _configs(child.parse_args(args), classes, skip)
        assert direct != baseline, f"{args}: the sample value is the default"
        up_ns = parser.parse_args(["up", *up_base, *args])
        argv = argv_of(Supervisor(UpArgs.from_args(up_ns)))
        assert argv[3] == command, argv
        via_up = _configs(parser.parse_args(argv[3:]), classes, skip)
        assert via_up == direct, f"kvmesh up {' '.join(args)} -> {argv[3:]}"
        checked += 1
    return checked


def _frontend_argv(sup: Supervisor) -> list[str]:
    """The frontend's argv, plus the API keys `up` hands it in its environment instead (a
    command line would show them to every user of the machine)."""
    argv = sup.frontend_argv()
    keys = [k for k in sup.frontend_env.get(API_KEY_ENV, "").split(",") if k]
    assert not any(k in a for k in keys for a in argv), argv
    return argv + (["--api-key", *keys] if keys else [])


def test_up_passes_every_child_flag_to_the_child(
    parser: argparse.ArgumentParser, tiny_model: Path, tmp_path: Path
) -> None:
    other_model = Path(shutil.copytree(tiny_model, tmp_path / "other-model"))
    base = [f"--model={tiny_model}", "--served-model-name=tiny-llama"]
    up_base = [f"--discovery=file://{tmp_path}"]
    # The frontend's KServe gRPC port defaults to off for `kvmesh frontend` and to a free port
    # for `up`: pin it to compare the rest (test_kserve_grpc_port_means_the_same covers it).
    fe_base = [*base, "--kserve-grpc-port=-1"]
    n = _check_child(
        parser,
        "frontend",
        [FrontendConfig, MeshConfig],
        fe_base,
        _frontend_argv,
        other_model,
        up_base,
    )
    assert n == len(dataclasses.fields(FrontendConfig)) + len(dataclasses.fields(MeshConfig)) - 2
    n = _check_child(
        parser,
        "router",
        [RouterServerConfig, MeshConfig],
        [],
        lambda sup: sup.router_argv(1234),
        other_model,
        [*up_base, *base],
    )
    assert n == len(dataclasses.fields(MeshConfig)) - 2  # all but discovery and router_address
    for kind, spec in ENGINES.items():
        # up gives torch workers a share of the cores when the flag is left at 0 (see below)
        threads = ["--torch-num-threads=3"] if spec.config is TorchConfig else []
        n = _check_child(
            parser,
            "worker",
            [WorkerConfig, spec.config],
            [*base, f"--engine={kind.value}", *threads],
            lambda sup: sup.worker_argv(Role.AGGREGATED, "w-0"),
            other_model,
            up_base,
        )
        own = len(dataclasses.fields(WorkerConfig)) - len(SET_BY_UP["worker"]) - 1  # engine
        assert n >= own + len(dataclasses.fields(spec.config)), kind


def test_up_splits_the_cores_among_its_torch_workers(
    parser: argparse.ArgumentParser, tiny_model: Path
) -> None:
    """Torch workers each using every core run many times slower when several share a machine
    (measured: 4 vs 204 req/s for 2 workers on 2 cores), so up gives each its share."""
    for flags, workers, want in (
        ([], 2, cpu_share(2)),
        (["--workers=1"], 1, cpu_share(1)),
        (["--workers=0", "--prefill-workers=1", "--decode-workers=2"], 3, cpu_share(3)),
        (["--torch-num-threads=5"], 2, 5),  # the operator's choice stands
    ):
        ns = parser.parse_args(["up", f"--model={tiny_model}", "--engine=torch", *flags])
        engine = UpArgs.from_args(ns).engine
        assert isinstance(engine, TorchConfig) and engine.num_threads == want, (flags, workers)
    cores = len(os.sched_getaffinity(0))
    assert cpu_share(1) == cores and cpu_share(2 * cores) == 1 and cpu_share(0) == cores


def test_up_sets_identity_flags_itself(
    parser: argparse.ArgumentParser, tiny_model: Path, tmp_path: Path
) -> None:
    commands = _commands(parser)
    up_flags = {s for a in commands["up"]._actions for s in a.option_strings}
    for command, names in SET_BY_UP.items():
        for a in commands[command]._actions:
            if a.dest in names and a.dest != "discovery":  # up has its own --discovery
                assert not set(a.option_strings) & up_flags, (command, a.option_strings)
                assert a.option_strings[0] in (UpConfig.__doc__ or ""), "documented"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--worker-id", "w"])
    ns = parser.parse_args(["up", f"--model={tiny_model}", "--router-process"])
    sup = Supervisor(UpArgs.from_args(ns))
    try:
        worker = from_args(WorkerConfig, parser.parse_args(sup.worker_argv(Role.DECODE, "d-1")[3:]))
        assert (worker.role, worker.worker_id, worker.discovery) == (
            Role.DECODE,
            "d-1",
            sup.discovery,
        )
        router_ns = parser.parse_args(sup.router_argv(4321)[3:])
        assert from_args(RouterServerConfig, router_ns).port == 4321
        mesh = from_args(MeshConfig, parser.parse_args(sup.frontend_argv("127.0.0.1:4321")[3:]))
        assert (mesh.router_address, mesh.discovery) == ("127.0.0.1:4321", sup.discovery)
    finally:
        assert sup.registry is not None
        shutil.rmtree(sup.registry)


def test_up_with_the_sla_planner_gives_its_routers_the_targets(
    parser: argparse.ArgumentParser, tiny_model: Path
) -> None:
    """The KV router keeps the SLO the planner sizes for (kv_policy, SLO), unless given its
    own; without the SLA planner it keeps none."""

    def router_slo(*flags: str) -> tuple[float, float]:
        ns = parser.parse_args(["up", f"--model={tiny_model}", *flags])
        sup = Supervisor(UpArgs.from_args(ns))
        try:
            mesh = from_args(MeshConfig, parser.parse_args(sup.frontend_argv()[3:]))
        finally:
            assert sup.registry is not None
            shutil.rmtree(sup.registry)
        return mesh.router_ttft_slo_ms, mesh.router_itl_slo_ms

    targets = ["--ttft-slo-ms=800", "--itl-slo-ms=40"]
    assert router_slo(*targets) == (0.0, 0.0)
    assert router_slo("--planner=queue", *targets) == (0.0, 0.0)
    assert router_slo("--planner=sla", *targets) == (800.0, 40.0)
    assert router_slo("--planner=sla", *targets, "--router-itl-slo-ms=25") == (800.0, 25.0)


def test_global_flags_before_or_after_the_command(parser: argparse.ArgumentParser) -> None:
    def level(*argv: str) -> LogLevel:
        return from_args(GlobalConfig, parser.parse_args(argv)).log_level

    assert level("worker") is LogLevel.INFO
    assert level("--log-level", "debug", "worker") is LogLevel.DEBUG
    assert level("worker", "--log-level", "warning") is LogLevel.WARNING
    assert level("--log-level", "debug", "up", "--log-level", "error") is LogLevel.ERROR
    assert level("model", "create", "--log-level", "debug") is LogLevel.DEBUG
    assert level("replay", "--trace", "t.jsonl", "--log-level", "debug") is LogLevel.DEBUG


def test_kserve_grpc_port_means_the_same(
    parser: argparse.ArgumentParser, tiny_model: Path, tmp_path: Path
) -> None:
    """-1: off, 0: a free port, N: port N, for `kvmesh frontend` and `kvmesh up` alike; only
    the defaults differ (the frontend: off; up: a free port, printed in its banner)."""
    fe = _commands(parser)["frontend"]
    assert from_args(FrontendConfig, fe.parse_args([])).kserve_grpc_port == -1
    assert (
        from_args(FrontendConfig, fe.parse_args(["--kserve-grpc-port", "0"])).kserve_grpc_port == 0
    )
    with pytest.raises(ConfigError, match="kserve_grpc_port"):
        from_args(FrontendConfig, fe.parse_args(["--kserve-grpc-port", "-2"]))

    def frontend_port(*up_args: str) -> int:
        ns = parser.parse_args(
            ["up", f"--model={tiny_model}", f"--discovery=file://{tmp_path}", *up_args]
        )
        argv = Supervisor(UpArgs.from_args(ns)).frontend_argv()
        return from_args(FrontendConfig, parser.parse_args(argv[3:])).kserve_grpc_port

    assert frontend_port() > 0  # up picked a free port (to print it)
    assert frontend_port("--kserve-grpc-port", "0") > 0
    assert frontend_port("--kserve-grpc-port", "-1") == -1
    assert frontend_port("--kserve-grpc-port", "8123") == 8123


def test_flags_compose_and_refuse_conflicts() -> None:
    @dataclasses.dataclass
    class A:
        """A."""

        model: str = opt("", "model")
        port: int = opt(0, "port")

    @dataclasses.dataclass
    class B:
        """B."""

        model: str = opt("", "model")
        size: int = opt(1, "size")

    @dataclasses.dataclass
    class C:
        """C."""

        size: int = opt(2, "another size")

    p = argparse.ArgumentParser()
    (Flags.of(A) + Flags.of(B)).without("port").with_defaults(size=5).add_to(p)
    ns = p.parse_args(["--model", "m"])
    assert (from_args(A, ns).model, from_args(B, ns).model, from_args(B, ns).size) == ("m", "m", 5)
    with pytest.raises(SystemExit):
        p.parse_args(["--port", "1"])
    with pytest.raises(ValueError, match="--size is declared twice"):
        (Flags.of(B) + Flags.of(C)).add_to(argparse.ArgumentParser())


def test_bad_flag_values_are_usage_errors(tiny_model: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", "up", "--prefill-workers", "1", "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "kvmesh up: error: --prefill-workers needs --decode-workers (they decode)"
    )


SPAWN_WITH_LIVE_GRPC = """
import asyncio, json, os, signal, sys
import grpc
from kvmesh.runtime.grpcutil import GrpcServer
from kvmesh.runtime.process import ChildProcess, run

forks = []
os.register_at_fork(before=lambda: forks.append(1))

async def main():
    server = GrpcServer("127.0.0.1", 0)
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        await channel.channel_ready()  # gRPC's threads are live
        code = "import os, sys; print(os.getsid(0) == os.getpid()); sys.exit(3)"
        quick = ChildProcess([sys.executable, "-c", code])
        slow = ChildProcess([sys.executable, "-c", "import time; time.sleep(60)"])
        exit_code = await quick.wait()
        slow.send_signal(signal.SIGTERM)
        killed = await asyncio.wait_for(slow.wait(), 30)
    await server.stop(0)
    print(json.dumps({"exit": exit_code, "killed": killed, "forks": len(forks)}))

run(main())
"""


def test_children_start_without_fork_while_grpc_is_live() -> None:
    """`kvmesh up` starts children while its gRPC threads are live: no fork, so no gRPC fork
    handler runs or logs `skipping fork() handlers`, and no Python at-fork hook runs."""
    result = subprocess.run(
        [sys.executable, "-c", SPAWN_WITH_LIVE_GRPC],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    *child_out, summary = result.stdout.splitlines()
    assert child_out == ["True"], "the child runs in its own session"
    assert json.loads(summary) == {"exit": 3, "killed": -15, "forks": 0}
    assert "fork_posix" not in result.stderr and "fork()" not in result.stderr, result.stderr


def test_every_listener_binds_loopback_by_default(parser: argparse.ArgumentParser) -> None:
    """No command listens beyond this machine unless told to: every `--*host` flag of a
    listener defaults to 127.0.0.1 (advertise hosts and remote addresses are not listeners)."""
    checked = 0
    for name, command in _commands(parser).items():
        for action in _flag_actions(command):
            if action.dest.endswith("host") and "advertise" not in action.dest:
                help_text = action.help or ""
                assert help_text.endswith("(default: '127.0.0.1')"), f"kvmesh {name} {action.dest}"
                checked += 1
    assert checked >= 3  # worker, router, frontend (and up, which passes them on)


def test_up_gives_each_worker_a_core_slot(
    parser: argparse.ArgumentParser, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines that bind threads to cores (vLLM on CPUs) take their slot's share of them rather
    than all binding to the same ones (kvmesh.workers.adapters.vllm_adapter.omp_threads_bind)."""
    import kvmesh.apps.up as up

    class Child:  # up.Child without a process
        def __init__(self, name: str, argv: list[str], metrics: str = "", env: Any = None) -> None:
            self.name, self.env, self.live = name, env, True

        def alive(self) -> bool:
            return self.live

    monkeypatch.setattr(up, "Child", Child)
    monkeypatch.setattr(Supervisor, "write_targets", lambda self: None)

    def supervisor(*flags: str) -> Supervisor:
        sup = Supervisor(
            UpArgs.from_args(parser.parse_args(["up", f"--model={tiny_model}", *flags]))
        )
        return sup

    sup = supervisor("--workers", "2")
    try:
        sup.start_worker()
        sup.start_worker()
        slots = [w.env for w in sup.workers]  # type: ignore[attr-defined]
        assert slots == [{CORE_SLOT_ENV: "0/2"}, {CORE_SLOT_ENV: "1/2"}]
        sup.workers[0].live = False  # type: ignore[attr-defined]  # its replacement takes its slot
        sup.start_worker()
        assert sup.workers[-1].env == {CORE_SLOT_ENV: "0/2"}  # type: ignore[attr-defined]
        sup.start_worker()  # more workers than slots (Scale): they share
        assert sup.workers[-1].env[CORE_SLOT_ENV] in ("0/2", "1/2")  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(sup.registry)  # type: ignore[arg-type]
    sup = supervisor("--workers", "1")  # alone: no slot, the engine's own binding
    try:
        sup.start_worker()
        assert sup.workers[0].env is None  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(sup.registry)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("slot", "cores", "expected"),
    [
        ("0/2", [1, 0], [0]),
        ("1/2", [0, 1], [1]),
        ("1/2", range(8), [4, 5, 6, 7]),
        ("2/3", range(8), [4, 5]),  # 8 // 3: two cores each, core 6 and 7 left out
        ("0/1", range(8), None),  # a single slot: nothing to split
        ("2/2", [0, 1], None),
        ("0/4", [0, 1], None),  # more slots than cores: they share all
        ("x/2", [0, 1], None),
        (None, [0, 1], None),
    ],
)
def test_core_slices(slot: str | None, cores: Any, expected: list[int] | None) -> None:
    assert core_slice(slot, cores) == expected
