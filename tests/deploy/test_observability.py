"""deploy/grafana and deploy/prometheus checked offline: the Prometheus config and rules pass
`promtool`, every dashboard query is valid PromQL, and every metric a query names is one that
kvmesh's components export (their real collectors, rendered)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.frontend.metrics import FrontendMetrics
from kvmesh.router.backend import DisaggStats
from kvmesh.router.metrics import DisaggCollector, RoutingCollector
from kvmesh.router.routing import RoutingStats
from kvmesh.runtime.metrics import render
from kvmesh.runtime.types import LoadInfo, ModelInfo
from kvmesh.workers.metrics import EngineStats, WorkerCollector
from tests.deploy.manifests import ROOT

pytestmark = pytest.mark.unit

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian's prometheus package)"
)
DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh.json"
PROMETHEUS = ROOT / "deploy" / "prometheus"


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def rule_queries() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def exported_names() -> set[str]:
    """Every sample name kvmesh's collectors expose (frontend, worker, router, disaggregation)."""
    registry = CollectorRegistry(auto_describe=False)
    frontend = FrontendMetrics(registry)
    frontend.model("m")  # per-model families appear once a model is known
    frontend.started("m", "chat_completions", "unary")  # request counters once one is counted
    frontend.finished("m", "chat_completions", "unary")
    info = ModelInfo("m", "mocker", 16, 64, 1024)
    registry.register(WorkerCollector("w", lambda: info, LoadInfo, EngineStats()))
    registry.register(RoutingCollector(RoutingStats(policy="kv")))
    registry.register(DisaggCollector(DisaggStats()))
    names: set[str] = set()
    for family in text_string_to_metric_families(render(registry).decode()):
        names |= {s.name for s in family.samples}
    return names


def test_every_metric_the_dashboard_and_rules_query_is_exported() -> None:
    exported = exported_names()
    queries = dashboard_queries() + rule_queries()
    assert len(dashboard_queries()) >= 20
    used = {m for q in queries for m in re.findall(r"\b(kvmesh_[a-z_]+)", q)}
    assert used, "no kvmesh metric in the queries"
    assert used <= exported, sorted(used - exported)


def test_the_dashboard_covers_what_the_readme_promises() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    titles = {p["title"] for p in panels if p["type"] != "row"}
    for title in (
        "Request rate",
        "Time to first token",
        "Inter-token latency",
        "KV cache usage per worker",
        "Prefix cache hit rate per worker",
        "Routing overhead",
        "Disaggregation",
    ):
        assert title in titles
    readme = (ROOT / "README.md").read_text()
    missing = sorted(t for t in titles if t not in readme)
    assert not missing, f"the README does not describe panels {missing}"


@needs_promtool
def test_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    for args in (
        ["check", "config", str(PROMETHEUS / "prometheus.yml")],
        ["check", "rules", str(PROMETHEUS / "rules.yml")],
    ):
        done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    rules = [
        {
            "record": f"kvmesh:panel_{i}",
            "expr": q.replace("$__rate_interval", "1m").replace("$model", ".*"),
        }
        for i, q in enumerate(dashboard_queries())
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    done = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
