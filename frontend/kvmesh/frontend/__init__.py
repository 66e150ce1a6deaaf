"""The gateway (kvmesh.frontend): OpenAI-compatible HTTP and KServe v2 (REST and gRPC).

- `service.OpenAIService`: tokenize, apply chat templates, fan out to a `backend.GenerateBackend`,
  detokenize, stop strings, usage, metrics; shared by every transport.
- `app.build_app` / `app.serve_http`: the aiohttp transport (OpenAI routes, health, metrics,
  `/openapi.json` from `openapi`, and the KServe v2 REST routes of `kserve_http`).
- `kserve_grpc`: the KServe v2 gRPC servicer (`inference.GRPCInferenceService`); `kserve`:
  KServe inference requests <-> text completions, shared by both KServe transports.
- `tool_parsers` / `reasoning`: tool calls and `<think>` reasoning read from model output.
- `protocol`: typed requests parsed from OpenAI JSON, typed results, SSE encoders.
- `tokenizer.Tokenizer`: tokenizer, chat template and special tokens of a local HF model dir
  (`tokencache` makes repeated prefixes cheap to tokenize; `detokenize` streams text out).
- `config.FrontendConfig`, `metrics.FrontendMetrics`, `errors` (domain errors -> HTTP),
  `testing.FakeBackend` (a scripted backend for tests and benchmarks).

Importing this package has no side effects.
"""
