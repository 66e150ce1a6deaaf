"""The PyTorch engine (`kvmesh worker --engine torch`): real Hugging Face causal LMs with
continuous batching, a paged KV cache with prefix caching and KV events, preemption and real
sampling, on CPU or CUDA.

This package's `__init__` imports no torch (the worker CLI reads TorchConfig for its flags);
import the engine from its module: `from kvmesh.workers.pytorch.engine import TorchEngine`.
Modules: config (TorchConfig), engine (TorchEngine, the async shell), scheduler (the synchronous
continuous-batching core), model_runner (loading and forward passes over the paged cache),
kv_cache (block storage), sampler (logits processors, sampling, logprobs), weights (random
test weights).
"""

from kvmesh.workers.pytorch.config import TorchConfig, TorchDType

__all__ = ["TorchConfig", "TorchDType"]
