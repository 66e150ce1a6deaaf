"""Engine adapters for vLLM, SGLang and TensorRT-LLM (`kvmesh worker --engine vllm|sglang|trtllm`).

Each adapter is a thin kvmesh Engine over the engine's own async Python API; see base.py for
what they share (streaming, cancellation, load), kv_translate.py and zmq_events.py for the KV
event path, and vllm_adapter.py / sglang_adapter.py / trtllm_adapter.py for each engine.
Importing this package (or any module here but *_runtime.py) imports no engine.
"""
