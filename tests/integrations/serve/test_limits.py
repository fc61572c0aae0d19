"""A request's limits, checked before any heavy work, and the CLI flags made from them (no Ray)."""
from __future__ import annotations

import json

import pytest

from flashspec_core.processors.sampling import MIN_TEMPERATURE
from flashspec_integrations.serve import protocol
from flashspec_integrations.serve.limits import Limits, check_request, schema_depth
from flashspec_integrations.serve.protocol import APIError, parse_request

MODEL = "m"
WINDOW = 8192


def request(**body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    return parse_request(json.dumps(body).encode())


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("body, limits, param, words", [
    ({"messages": [{"role": "user", "content": "x"}] * 5}, Limits(max_messages=4), "messages",
     "5 given; this server takes at most 4 (--max-messages)"),
    ({"tools": [tool({})] * 3}, Limits(max_tools=2), "tools", "--max-tools"),
    ({"stop": ["a", "b", "c"]}, Limits(max_stop=2), "stop", "--max-stop"),
    ({"stop": "abcdef"}, Limits(max_stop_chars=5), "stop", "--max-stop-chars"),
    ({"max_tokens": 65}, Limits(max_tokens=64), "max_tokens", "at most 64 new tokens"),
    ({"max_completion_tokens": 65}, Limits(max_tokens=64), "max_completion_tokens", "--max-tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": nested(20)}}}, Limits(),
     "response_format.json_schema.schema", "nests 41 levels deep; this server takes at most 32"),
    ({"tools": [tool({"type": "object"}), tool(nested(20))]}, Limits(), "tools[1].function.parameters",
     "--max-schema-depth"),
    ({"tools": [tool({"enum": ["x" * 100] * 30})] * 2, "tool_choice": "required"}, Limits(max_schema_bytes=5000),
     "tools", "a forced call (tool_choice 'required') is decoded under one schema"),
    ({"tools": [tool({"enum": ["x" * 100] * 100})]}, Limits(max_schema_bytes=5000), "tools[0].function.parameters",
     "bytes as compact JSON; this server takes at most 5000"),
    ({"domain": "Made-Up"}, Limits(), "domain", "'Made-Up' is not a router domain of this server"),
    ({"metadata": {"flashspec_domain": "nope"}}, Limits(), "metadata.flashspec_domain", "--domains"),
    ({"messages": [{"role": "user", "content": "\n" * 1601}]}, Limits(max_prompt_tokens=100), "messages",
     "1601 characters, more than 100 tokens can hold"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 1601}]}]}, Limits(max_prompt_tokens=100),
     "messages", "--prompt-chars-per-token 16"),
    ({"tools": [tool({"description": "z" * 1600})]}, Limits(max_prompt_tokens=100), "messages", "characters"),
])
def test_each_limit_is_a_400_naming_the_field_and_the_flag(body, limits, param, words):
    with pytest.raises(APIError) as err:
        check_request(request(**body), limits, WINDOW)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def test_what_is_within_the_limits_passes():
    check_request(request(max_tokens=64, stop=["a"] * 16, domain=" Code ", metadata={"flashspec_domain": "tool/result"},
                          tools=[tool(nested(15))], messages=[{"role": "user", "content": "x" * 800}]),
                  Limits(max_tokens=64, max_prompt_tokens=100), WINDOW)
    check_request(request(domain="mine"), Limits(domains=["Mine"]), WINDOW)  # the operator's own domain
    assert (Limits().prompt_tokens(WINDOW) == WINDOW - 1
            and Limits(max_prompt_tokens=10 ** 6).prompt_tokens(WINDOW) == WINDOW - 1)


def test_schema_depth_needs_no_recursion():
    assert schema_depth(3) == 0 and schema_depth({}) == 1 and schema_depth({"a": [1, {"b": []}]}) == 4
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert schema_depth(deep) == 100_001  # Python's recursion limit is about 1,000


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": 0.005}, "temperature", "must be 0 (greedy) or at least 0.01"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"seed": 2 ** 64}, "seed", "less than 18446744073709551616"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512"),
    ({"metadata": {"k": 3}}, "metadata.k", "valid string"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
])
def test_sampling_and_metadata_the_engine_refuses_are_400s(body, param, words):
    with pytest.raises(APIError) as err:
        request(**body)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message
    assert request(temperature=0, seed=0).seed == 0 and request(temperature=0.01, seed=2 ** 64 - 1).temperature == 0.01


def test_the_protocol_keeps_the_engines_lowest_temperature():
    assert protocol.MIN_TEMPERATURE == MIN_TEMPERATURE


def test_the_cli_flags_are_the_limits(capsys):
    from flashspec_integrations.cli import build_parser, main
    from flashspec_integrations.serve.command import limits_from

    args = build_parser().parse_args(["serve", "--max-messages", "7", "--domains", "a", "b",
                                      "--compile-timeout-s", "0.5"])
    assert limits_from(args) == Limits(max_messages=7, domains=["a", "b"], compile_timeout_s=0.5)
    assert limits_from(build_parser().parse_args(["serve"])) == Limits()
    assert main(["serve", "--max-messages", "0"]) == 2
    assert "--max-messages input should be greater than 0; got 0" in capsys.readouterr().err
    assert main(["serve", "--max-in-flight", "0"]) == 2
    assert "--max-in-flight must be >= 1" in capsys.readouterr().err
