"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine (none on these machines).

The compose file is read with PyYAML: the services, their dependency conditions and healthchecks, and the crest
services' commands parsed by crest's own CLI parser. Every `COPY` source of the Dockerfile must exist in the
build context. Where `docker-compose` is installed, its `config` must accept the file too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from crest.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    return found


def test_services_start_in_order_with_healthchecks(services: dict[str, Any]) -> None:
    assert set(services) == {"postgres", "ingest", "server"}
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["ingest"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["server"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "ingest": {"condition": "service_completed_successfully"},
    }
    assert "/health" in " ".join(services["server"]["healthcheck"]["test"])
    assert services["server"]["stop_signal"] == "SIGTERM"
    for name in ("ingest", "server"):
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile" and services[name]["image"] == "crest:local"
        assert services[name]["environment"]["CREST_DATABASE_URL"].endswith("@postgres:5432/crest")


@pytest.mark.parametrize("name", ["ingest", "server"], ids=["ingest", "server"])
def test_commands_parse_as_crest_commands(services: dict[str, Any], name: str) -> None:
    args = [a.replace("${CREST_STORE:-demo}", "demo") for a in services[name]["command"]]
    group = typer.main.get_command(app)
    command = getattr(group, "commands", {}).get(args[0])
    assert command is not None, args[0]
    params = command.make_context(args[0], args[1:]).params  # raises on an unknown option or a bad value
    assert params["store"] == "demo"
    if name == "server":
        assert params["host"] == "0.0.0.0" and params["port"] == 8000


def test_dockerfile_copies_existing_paths() -> None:
    copies = [
        line.split()[1:] for line in DOCKERFILE.read_text(encoding="utf-8").splitlines() if line.startswith("COPY ")
    ]
    sources = [src for parts in copies for src in parts[:-1]]
    assert {"client/", "crest/", "migrations/", "sql/", "pyproject.toml"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_config_accepts_the_file() -> None:
    done = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
