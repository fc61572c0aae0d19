"""Authentication against the real server: no key, a wrong key, the right key; health without one."""
from __future__ import annotations

import pytest

from .conftest import API_KEY, MODEL

pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("headers, words", [
    ({}, "no API key was given"),
    ({"authorization": "Bearer wrong-key"}, "not this server's"),
    ({"authorization": API_KEY}, "not this server's"),
])
def test_without_the_right_key_every_api_route_is_a_401(service, headers, words):
    for method, path, body in (("POST", "/chat/completions", CHAT), ("GET", "/models", None)):
        res = httpx.request(method, service[0] + path, json=body, headers=headers, timeout=60)
        error = res.json()["error"]
        assert res.status_code == 401 and words in error["message"] and error["code"] == "invalid_api_key", error


def test_the_openai_client_with_a_wrong_key_raises_authentication_error(service):
    wrong = openai.OpenAI(base_url=service[0], api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError, match="not this server's"):
        wrong.chat.completions.create(**CHAT)


def test_the_right_key_is_served_and_health_needs_none(client, service):
    assert client.chat.completions.create(**CHAT).choices[0].message.content
    health = httpx.get(service[0].removesuffix("/v1") + "/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] in ("ok", "busy"), health.text
    assert health.json()["model"] == MODEL and health.json()["max_in_flight"] > 0
