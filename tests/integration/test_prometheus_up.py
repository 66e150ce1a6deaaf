"""A real Prometheus (Debian's `prometheus`) scrapes every process of `kvmesh up` (frontend,
standalone router, workers) through the file_sd target list `kvmesh up --metrics-targets`
writes, with deploy/prometheus's recording rules; after a short load, PromQL for the request
rate, TTFT p90 and the KV hit rate returns sane values."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.runtime.ports import free_port
from tests.integration.test_up_openai import start_mesh, stop_mesh
from tests.integration.test_worker_observability import promtool_check
from tests.procs import poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMETHEUS = shutil.which("prometheus")
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def scalar(base: str, promql: str) -> float | None:
    result = query(base, promql)
    return float(result[0]["value"][1]) if result else None


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian's prometheus)")
def test_prometheus_scrapes_every_component_and_answers_promql(
    tiny_model: Path, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    targets = tmp_path / "targets"
    targets.mkdir()
    mesh = start_mesh(
        tmp_path, "--router-process", "--metrics-targets", str(targets / "kvmesh.json")
    )
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {
                        "job_name": "kvmesh",
                        "file_sd_configs": [
                            {"files": [str(targets / "*.json")], "refresh_interval": "1s"}
                        ],
                    }
                ],
            }
        )
    )
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        expected = len(json.loads((targets / "kvmesh.json").read_text()))
        assert expected == 4  # frontend, router, 2 workers

        def all_up() -> bool:
            try:
                return scalar(base, 'sum(up{job="kvmesh"})') == expected
            except OSError:
                return False

        poll(all_up, 60, "Prometheus to scrape every kvmesh process", interval_s=0.5)
        components = {r["metric"]["component"] for r in query(base, 'up{job="kvmesh"}')}
        assert components == {"frontend", "router", "worker"}

        client = mesh.client()
        system = "You are a helpful assistant. " * 20  # a shared prefix: prefix-cache hits
        for i in range(24):
            client.chat.completions.create(
                model="tiny-llama",
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"q{i}"},
                ],
                max_tokens=4,
            )
            time.sleep(0.1)
        time.sleep(3)  # a few more scrapes

        rate = scalar(base, "sum(rate(kvmesh_frontend_requests_total[30s]))")
        assert rate is not None and 0.1 < rate < 50, rate
        ttft = scalar(
            base,
            "histogram_quantile(0.9, sum by (le) "
            "(rate(kvmesh_frontend_time_to_first_token_seconds_bucket[1m])))",
        )
        assert ttft is not None and 0 < ttft < 5, ttft
        hit = scalar(
            base,
            "sum(rate(kvmesh_worker_prefix_cache_hits_total[1m])) / "
            "sum(rate(kvmesh_worker_prefix_cache_queries_total[1m]))",
        )
        assert hit is not None and 0.3 < hit < 1, hit  # most of each prompt is the prefix
        decisions = scalar(base, "sum(kvmesh_router_decisions_total)")
        assert decisions == 24
        # The frontend's pool and the router's each see both workers, none marked down.
        pools = query(base, 'kvmesh_router_workers{role="aggregated"}')
        assert sorted((r["metric"]["component"], r["value"][1]) for r in pools) == [
            ("frontend", "2"),
            ("router", "2"),
        ], pools
        assert scalar(base, "sum(kvmesh_router_workers_down)") == 0
        # Every endpoint's exposition passes `promtool check metrics`.
        for group in json.loads((targets / "kvmesh.json").read_text()):
            for target in group["targets"]:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
                    promtool_check(r.read().decode())
        # The recording rule (per worker; NaN for a worker that saw no prompt in the window).
        recorded = poll(
            lambda: query(base, "kvmesh:prefix_cache_hit_rate:ratio_rate1m > 0"),
            20,
            "the recording rules to evaluate",
        )
        assert all(0 < float(r["value"][1]) <= 1 for r in recorded), recorded
    finally:
        prom.terminate()
        prom.wait(20)
        log.close()
        assert stop_mesh(mesh) == 0, mesh.log.read_text()
