"""Structured outputs and tool calls through the official `openai` client, against
Qwen2.5-Coder 0.5B on the CPU: JSON schemas (every output validates with `jsonschema`),
`json_object`, GBNF and Lark grammars, required and named tool calls (every call parses
into a declared function with valid arguments), streaming equal to non-streaming, tool
results through the template, and clear 400s for bad schemas and grammars.

The requests run 16 at a time (the server's `-np`) with short outputs: the schemas bound
their strings, and the grammars allow no free whitespace."""

import concurrent.futures
import json

import jsonschema
import pytest

from test_openai import error_of

CONCURRENCY = 16

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            },
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                     "minItems": 1, "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "maxItems": 3},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "language": {"type": "string", "enum": ["python", "rust", "c", "other"]},
        },
        "required": ["sentiment", "language"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10},
        },
        "required": ["age", "rating", "count"],
        "additionalProperties": False,
    },
    "required_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "done": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 16},
            "priority": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["title", "done", "priority"],
        "additionalProperties": False,
    },
}

PROMPTS = [
    "Describe a person who lives in Paris.",
    "Summarize: the new Rust release is fast and safe.",
    "I love this Python library!",
    "Give me data about a cat named Tom.",
    "A todo item: buy milk tomorrow.",
    "Rate the movie Inception.",
    "Tell me about a user of a C compiler who is 30 years old.",
    "The weather today is terrible.",
    "Extract information: Alice, 34, lives in Berlin, zip 10115.",
    "Write a JSON record for a book.",
    "Classify: this code crashes every time.",
    "Generate a sample record.",
    "Bob is a software engineer from Boston.",
    "Review: the food was okay, nothing special.",
    "A task: fix the login bug, high priority.",
    "Make up some tags for a blog post about cooking.",
    "Information about the city of Tokyo.",
    "How old is the universe, roughly, in a fun record?",
    "Product feedback: the app is great but slow.",
    "Create an entry for a meeting on Monday.",
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    }},
    {"type": "function", "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    }},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

TOOL_PROMPTS = [
    "What's the weather like in Paris?",
    "What is 17 plus 25?",
    "Is it raining in London right now?",
    "Add 3 and 4 for me.",
    "Tell me the temperature in Tokyo in fahrenheit.",
    "Compute 100 + -7.",
    "Weather in Berlin?",
    "What do I get if I add 12 to 30?",
]


def run_all(fn, items):
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(fn, items))


def chat(client, prompt, **kw):
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], **kw)


def test_json_schema_outputs_validate(qwen):
    client = qwen.client()
    cases = [(i, name) for i in range(len(PROMPTS)) for name in SCHEMAS]

    def one(case):
        i, name = case
        # Greedy and sampled, both through the mask.
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
        r = chat(client, PROMPTS[i] + " Answer in JSON.", **sampling,
                 response_format={"type": "json_schema", "json_schema": {
                     "name": name, "schema": SCHEMAS[name], "strict": True}})
        return case, r.choices[0]

    for (i, name), choice in run_all(one, cases):
        text = choice.message.content
        assert choice.finish_reason == "stop", (name, i, text)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[name])


def test_json_object_outputs_parse(qwen):
    client = qwen.client()

    def one(i):
        r = chat(client, PROMPTS[i] + " Reply with a small JSON object.", temperature=0,
                 response_format={"type": "json_object"}, max_tokens=200)
        return r.choices[0]

    for choice in run_all(one, range(8)):
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_llama_server_grammar_and_json_schema_fields(qwen):
    # GBNF on the chat endpoint, Lark and a top-level json_schema on completions.
    r = qwen.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        "grammar": 'root ::= ("yes" | "no") "."', "temperature": 0, "max_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes.", "no.")
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    r = qwen.post("/v1/completions", {
        "prompt": "The answer is", "grammar": 'start: " " /[0-9]{1,3}/', "temperature": 0,
        "max_tokens": 10})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith(" ") and text[1:].isdigit() and len(text) <= 4, text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"],
              "additionalProperties": False}
    r = qwen.post("/v1/completions", {
        "prompt": "A JSON object with a number: ", "json_schema": schema, "temperature": 0,
        "max_tokens": 30})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def check_calls(message, allowed):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name in allowed, call
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "add"])
def test_required_and_named_tool_calls_always_parse(qwen, choice):
    client = qwen.client()
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    allowed = set(PARAMS) if choice == "required" else {choice}

    def one(i):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
        r = chat(client, TOOL_PROMPTS[i], tools=TOOLS, tool_choice=tool_choice, **sampling)
        return r.choices[0]

    for c in run_all(one, range(len(TOOL_PROMPTS))):
        assert c.finish_reason == "tool_calls", c
        check_calls(c.message, allowed)


def streamed_calls(stream):
    """The calls and content of a streamed chat completion, as a client assembles them."""
    calls, content, finish = {}, "", None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert c["id"] is None, "the id comes once, in the first piece"
                    c["id"] = tc.id
                    assert tc.type == "function"
                if tc.function and tc.function.name:
                    c["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_calls_equal_non_streamed(qwen, tool_choice):
    client = qwen.client()

    def one(i):
        kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=100)
        full = chat(client, TOOL_PROMPTS[i], **kw).choices[0]
        calls, content, finish = streamed_calls(chat(client, TOOL_PROMPTS[i], stream=True, **kw))
        return full, calls, content, finish

    for full, calls, content, finish in run_all(one, range(4)):
        want = [(c.function.name, json.loads(c.function.arguments))
                for c in full.message.tool_calls or []]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want
        assert all(c["id"].startswith("call_") for c in calls)
        assert finish == full.finish_reason
        if want:
            assert finish == "tool_calls"
            check_calls(full.message, set(PARAMS))
        else:
            assert content == full.message.content


def test_tool_results_go_back_through_the_template(qwen):
    client = qwen.client()
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_abc", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 degrees and sunny"},
    ]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                       temperature=0, max_tokens=40)
    without = client.chat.completions.create(model="m", messages=messages[:1], tools=TOOLS,
                                             temperature=0, max_tokens=1)
    # The call and its result are in the prompt (Qwen's template writes both).
    assert r.usage.prompt_tokens > without.usage.prompt_tokens + 20
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_schemas_and_grammars_are_400s(qwen):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#/$defs/nope"}}}}, "response_format", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
         "response_format", None),
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"grammar": "root ::= [a-"}, "grammar", "class"),
        ({"grammar": "item ::= \"a\""}, "grammar", "root"),
        ({"grammar": "start: undefined_rule"}, "grammar", "undefined_rule"),
        ({"json_schema": "not an object"}, "json_schema", None),
        ({"grammar": "start: \"a\"", "json_schema": {}}, "json_schema", None),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}],
          "tool_choice": "required"}, "tools", "strin"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", None),
    ]
    for extra, param, needle in cases:
        r = qwen.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, **extra})
        e = error_of(r, 400, param)
        if needle:
            assert needle in e["message"], (extra, e)
    # A schema too large to compile is refused, not compiled for ever; the server goes on.
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "(a|b)*c" * 40}
                                            for i in range(3000)}}
    r = qwen.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": big}}}, timeout=60)
    error_of(r, 400, "response_format")
    r = qwen.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
