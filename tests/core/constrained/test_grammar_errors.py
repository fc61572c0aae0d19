"""A schema or grammar xgrammar refuses is a ValueError naming the argument and the problem, with
none of xgrammar's insides (its C++ logger prefixes "[hh:mm:ss] /project/cpp/<file>.cc:<line>: ")."""
from __future__ import annotations

import re

import pytest
from helpers import tiny_tokenizer

from flashspec_core.constrained import tool_tags
from flashspec_core.constrained.grammar import Grammar, compile_json_schema, compile_structural_tag

VOCAB, EOS = 16, 15
INSIDES = re.compile(r"\.(cc|cpp|h)\b|/project/|\[\d\d:\d\d:\d\d\]")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(VOCAB, EOS)


@pytest.mark.parametrize("schema, problem", [
    ({"type": "strin"}, 'json_schema: xgrammar cannot compile this schema: Unsupported type "strin"'),
    ({"$ref": "#/nope"}, "json_schema: xgrammar cannot compile this schema: Cannot find field 'nope' in #/nope"),
    ({"type": "string", "pattern": "("},
     "this schema: Regex parsing error at position 2: The parenthesis is not closed."),
    ({"type": "string", "pattern": "[z-a]"},
     "this schema: EBNF parser error at line 1, column 11: Invalid character class"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1},
     "this schema: minItems is greater than maxItems: 3 > 1"),
])
def test_a_schema_xgrammar_refuses_names_the_problem_and_nothing_of_xgrammars_sources(tokenizer, schema, problem):
    with pytest.raises(ValueError) as err:
        compile_json_schema(schema, tokenizer, VOCAB, [EOS])
    message = str(err.value)
    assert problem in message and not INSIDES.search(message), message
    assert message == message.strip()


def test_a_bad_schema_inside_a_structural_tag_and_a_bad_grammar_too(tokenizer):
    tool = {"type": "function",
            "function": {"name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}
    with pytest.raises(ValueError) as err:
        compile_structural_tag(tool_tags([tool]), tokenizer, VOCAB, [EOS])
    assert str(err.value) == ("json_schema: xgrammar cannot compile a schema inside the structural tag: "
                              "Invalid range: minimum greater than maximum")
    with pytest.raises(ValueError) as err:
        Grammar.from_ebnf("root ::= x", [f"t{i}" for i in range(VOCAB)], [EOS])
    assert str(err.value) == ('ebnf: the grammar does not compile: EBNF parser error at line 1, column 10: '
                              'Rule "x" is not defined')
