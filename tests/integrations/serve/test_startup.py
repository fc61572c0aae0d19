"""`start` waits for the replicas within `ready_timeout_s`, or says what Ray Serve reports."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

serve = pytest.importorskip("ray.serve", reason="needs the 'serve' extra")

from flashspec_integrations.serve.command import APP_NAME, _run_within


def test_a_deploy_that_ends_in_time_returns_and_one_that_fails_raises_its_error():
    done = []
    _run_within(lambda: done.append(1), 5.0)
    assert done == [1]
    with pytest.raises(RuntimeError, match="replica constructor failed"):
        _run_within(lambda: (_ for _ in ()).throw(RuntimeError("replica constructor failed")), 5.0)


def test_replicas_not_up_in_time_raise_a_timeout_naming_the_deployments_state(monkeypatch):
    release = threading.Event()
    deployment = SimpleNamespace(status=SimpleNamespace(value="UPDATING"),
                                 message="2 replicas have taken more than 30s to initialize")
    status = SimpleNamespace(applications={APP_NAME: SimpleNamespace(deployments={"FlashSpecServer": deployment})})
    monkeypatch.setattr(serve, "status", lambda: status)
    try:
        with pytest.raises(TimeoutError, match=r"not up within 0.2 s \(FlashSpecServer: UPDATING 2 replicas"):
            _run_within(lambda: release.wait(10), 0.2)
    finally:
        release.set()
