"""The metric names ``deploy/`` uses (manifests, KEDA and HPA queries, the Grafana dashboard, docs/DEPLOY.md)
and the names a ``/metrics`` page exports: every one used must be exported, by ``jaxinfer serve``
(tests/test_deploy.py) and by the Ray ingress (tests/test_ray_serve.py) alike."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# Colons are legal in Prometheus names; a name starts with a letter (image tags do not).
_METRIC_NAME = re.compile(r"jaxinfer:[a-zA-Z_][a-zA-Z0-9_:]*")


def deploy_files() -> list[Path]:
    return [p for p in DEPLOY.rglob("*") if p.is_file() and "node_modules" not in p.parts] + [ROOT / "docs" / "DEPLOY.md"]


def metric_names_used_in_deploy() -> set[str]:
    return {m for p in deploy_files() for m in _METRIC_NAME.findall(p.read_text())}


def exported_metric_names(text: str) -> set[str]:
    """Family and sample names of a Prometheus text page."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names
