"""A real gateway process (HTTP + KServe v2 gRPC) over a scripted in-process backend.

Why a process: kvmesh's generated `inference` protobuf module and tritonclient's register the
same symbols (`inference.ServerLiveRequest`, ...) in protobuf's default descriptor pool, so they
cannot be imported into one process (the same clash KServe and MLServer have with
tritonclient). Tests therefore run the KServe gRPC server in this subprocess and talk to it with
the real tritonclient (or tritonclient's stubs) from the pytest process.

    python -m tests.fake_gateway --model-dir DIR     # prints {"http": port, "grpc": port}

Models: "tiny" (plain engine) and "tiny-guided" (advertises GUIDED_DECODING and EMBEDDINGS).
Directives in the prompt text script each request:
  @error:unavailable@ / @error:exhausted@ / @error:internal@   fail before the first token
  @midfail@    fail after two outputs          @slow@    20 ms per output
  @say:TEXT@   generate exactly the tokens of TEXT (then EOS)
Anything else generates the tokens of kvmesh.frontend.testing.DEFAULT_TEXT (then EOS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path
from typing import Any


def _scripted_backend() -> Any:
    """The ScriptedBackend class (built lazily: it needs kvmesh imports)."""
    from kvmesh.frontend.testing import DEFAULT_TEXT, FakeBackend
    from kvmesh.frontend.tokenizer import Tokenizer
    from kvmesh.runtime.errors import ResourceExhausted, Unavailable
    from kvmesh.runtime.tracing import TraceContext
    from kvmesh.runtime.types import EngineOutput, EngineRequest

    directive = re.compile(r"@(error:[a-z]+|midfail|slow|say:[^@]*)@")

    class ScriptedBackend(FakeBackend):
        """FakeBackend whose behaviour per request comes from directives in the prompt."""

        tok: Tokenizer | None = None

        def _directives(self, request: EngineRequest) -> list[str]:
            assert self.tok is not None
            return directive.findall(self.tok.decode(request.prompt, skip_special_tokens=False))

        def _script(self, request: EngineRequest) -> Sequence[int]:
            assert self.tok is not None
            for d in self._directives(request):
                if d.startswith("say:"):
                    return self.tok.encode(d[4:])
            return self.tok.encode(DEFAULT_TEXT)

        def generate(
            self, model: str, request: EngineRequest, trace: TraceContext | None
        ) -> AsyncGenerator[EngineOutput, None]:
            return self._scripted(model, request, trace)

        async def _scripted(
            self, model: str, request: EngineRequest, trace: TraceContext | None
        ) -> AsyncGenerator[EngineOutput, None]:
            directives = self._directives(request)
            if "error:unavailable" in directives:
                raise Unavailable("no worker (scripted)")
            if "error:exhausted" in directives:
                raise ResourceExhausted("overloaded (scripted)")
            if "error:internal" in directives:
                raise RuntimeError("scripted internal failure")
            delay = 0.02 if "slow" in directives else 0.0
            count = 0
            async for out in super().generate(model, request, trace):
                if "midfail" in directives and count == 2:
                    raise Unavailable("worker went away (scripted)")
                count += 1
                if delay:
                    await asyncio.sleep(delay)
                yield out

        async def embed(
            self, model: str, prompts: list[list[int]], trace: TraceContext | None
        ) -> list[list[float]]:
            return [[float(len(p)), 1.0, 0.5, 0.25] for p in prompts]

    return ScriptedBackend


async def serve(model_dir: Path) -> None:
    """Run the gateway until SIGTERM (imports kvmesh's KServe protos: never in pytest)."""
    from kvmesh.frontend.app import build_app, serve_http
    from kvmesh.frontend.config import FrontendConfig
    from kvmesh.frontend.kserve_grpc import serve_kserve_grpc
    from kvmesh.frontend.service import OpenAIService
    from kvmesh.frontend.testing import model_info
    from kvmesh.frontend.tokenizer import Tokenizer
    from kvmesh.runtime.tinymodel import create_tiny_model

    ScriptedBackend = _scripted_backend()
    tok = Tokenizer.from_pretrained(create_tiny_model(model_dir))
    backend = ScriptedBackend(
        [
            model_info("tiny", context_length=512),
            dataclasses.replace(
                model_info("tiny-guided", context_length=512),
                capabilities=("LOGPROBS", "GUIDED_DECODING", "EMBEDDINGS"),
            ),
        ],
        eos_token_id=tok.eos_token_ids[-1],
        history=100,
    )
    backend.tok = tok
    backend.tokens = backend._script
    config = FrontendConfig(max_request_bytes=256 * 1024)
    service = OpenAIService(backend, {"tiny": tok, "tiny-guided": tok}, config)
    runner, http_port = await serve_http(build_app(service), "127.0.0.1", 0)
    grpc_server = await serve_kserve_grpc(service, "127.0.0.1", 0)
    print(json.dumps({"http": http_port, "grpc": grpc_server.port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await grpc_server.stop(0)
    await runner.cleanup()


@dataclasses.dataclass
class RunningGateway:
    """A fake gateway process started by `running`."""

    proc: subprocess.Popen[bytes]
    http: str
    """http://127.0.0.1:port"""
    grpc: str
    """127.0.0.1:port of the KServe v2 gRPC server"""


@contextlib.contextmanager
def running(model_dir: Path, log: Path | None = None) -> Iterator[RunningGateway]:
    """Start `python -m tests.fake_gateway` and stop it afterwards (stderr to `log`)."""
    root = Path(__file__).resolve().parent.parent
    stderr = log.open("wb") if log is not None else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_gateway", "--model-dir", str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=root,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the fake gateway did not start")
        ports = json.loads(line)
        yield RunningGateway(
            proc, f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if stderr is not None:
            stderr.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(Path(args.model_dir)))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
