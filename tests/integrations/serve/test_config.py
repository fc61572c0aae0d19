"""The documented multi-host config file is a valid Ray Serve config that builds this application."""
from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
schema = pytest.importorskip("ray.serve.schema", reason="needs the 'serve' extra")

from flashspec_integrations.serve.deployment import (
    DEPLOYMENT_NAME,
    ONGOING_HEADROOM,
    ServeSettings,
    build_app,
)
from flashspec_integrations.serve.limits import Limits

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "serve_config.yaml"


def test_the_example_config_validates_and_builds():
    config = schema.ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "flashspec_integrations.serve.deployment:build_app"
    assert [d.name for d in app.deployments] == [DEPLOYMENT_NAME]
    settings = ServeSettings.model_validate(app.args)  # every arg is a setting the replicas take
    assert build_app(app.args) is not None
    (deployment,) = app.deployments  # Ray's queue sits just above the replica's own count (admission)
    assert deployment.max_ongoing_requests == settings.max_in_flight + ONGOING_HEADROOM
    assert settings.api_key is None and settings.limits == Limits()  # the key comes from each node's env


def test_unknown_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="max_batch"):
        build_app({"max_batch": 4})


def test_the_cli_refuses_bad_arguments_before_starting_ray(capsys):
    from flashspec_integrations.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--memory-fraction", "1.5"]) == 2
    assert "--memory-fraction must be in (0, 1]" in capsys.readouterr().err
    assert main(["serve", "--max-context", "1"]) == 2
    assert "--max-context must be >= 2" in capsys.readouterr().err
    for field, bad in (("memory_fraction", 0), ("max_context", 1)):
        with pytest.raises(ValueError, match=field):
            ServeSettings.model_validate({field: bad})
