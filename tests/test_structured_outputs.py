"""Structured outputs on every front end, against a real gateway over the tiny random-weight pair: OpenAI's
response_format and vLLM's structured_outputs over HTTP, ResponseFormat over gRPC (the Python client and the raw
stub), and `tandem generate`'s flags. A random model writes no JSON of its own, so every parse below holds only
because the format reached the engine."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest

from gateway_harness import tiny_http_server
from tandem.cli.main import main
from tandem.client import TandemClient
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

MODEL = "tiny-target"
CHAT = [{"role": "user", "content": "Describe a colour as JSON."}]
# Bounded: every output that follows it fits in far fewer than MAX_TOKENS tokens, so each one ends at a whole match.
# The x-guidance option allows one space between JSON tokens (the default allows 32, all a random model writes).
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "name": {"type": "string", "maxLength": 8}},
          "required": ["color", "ok", "n", "name"], "additionalProperties": False,
          "x-guidance": {"whitespace_pattern": "[ ]{0,1}"}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
REGEX = r"[a-z]{3,8}-[0-9]{2}"
CHOICES = ["yes", "no", "a.b (c)?"]
MAX_TOKENS = 256
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from tiny_http_server(tiny_models, max_prompt_tokens=2048)


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0, timeout=120)


def _post(server, endpoint: str, body: dict) -> httpx.Response:
    prompt = {"messages": CHAT} if endpoint == "chat/completions" else {"prompt": "Colour as JSON:"}
    return httpx.post(f"{server.gateway.http_url}/v1/{endpoint}", json={"model": MODEL} | prompt | body, timeout=120)


def _texts(response: httpx.Response) -> list[tuple[str, str]]:
    """(text, finish reason) of each choice of a 200 response, chat's or completions'."""
    assert response.status_code == 200, response.text
    return [(c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
            for c in response.json()["choices"]]


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_a_json_schema_holds_for_every_choice_on_both_endpoints(server, endpoint: str) -> None:
    """Each of 8 sampled choices parses and validates, and each ends at a whole match (the schema is bounded)."""
    choices = _texts(_post(server, endpoint, {"response_format": JSON_SCHEMA, "n": 8, **SAMPLED}))
    assert len(choices) == 8 and all(reason == "stop" for _, reason in choices), choices
    values = [_valid(text) for text, _ in choices]
    assert len({json.dumps(value, sort_keys=True) for value in values}) > 1  # sampled, not one forced text
    # vLLM's spelling of the same request: the schema as an object, or as its text.
    for schema in (SCHEMA, json.dumps(SCHEMA)):
        again = _texts(_post(server, endpoint, {"structured_outputs": {"json": schema}, "n": 2, **SAMPLED}))
        assert all(reason == "stop" for _, reason in again) and [_valid(text) for text, _ in again]


def test_json_object_gives_json_objects(server) -> None:
    response = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, n=6,
                                                    response_format={"type": "json_object"}, **SAMPLED)
    stopped = [c.message.content for c in response.choices if c.finish_reason == "stop"]
    assert stopped, [c.finish_reason for c in response.choices]
    assert all(isinstance(json.loads(text), dict) for text in stopped)
    # text is no format at all: the random model's bytes are no JSON.
    free = _sdk(server).chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "text"},
                                                extra_body={"ignore_eos": True}, **SAMPLED | {"max_tokens": 24})
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_regex_and_choice_match_whole(server, endpoint: str) -> None:
    texts = _texts(_post(server, endpoint, {"structured_outputs": {"regex": REGEX}, "n": 4, **SAMPLED}))
    assert all(reason == "stop" and re.fullmatch(REGEX, text) for text, reason in texts), texts
    picked = _texts(_post(server, endpoint, {"structured_outputs": {"choice": CHOICES}, "n": 6, **SAMPLED}))
    assert all(reason == "stop" and text in CHOICES for text, reason in picked), picked


GBNF = 'root ::= word "=" [0-9] [0-9]?\nword ::= [a-z] [a-z] [a-z]?'
LARK = 'start: WORD "=" NUM\nWORD: /[a-z]{2,3}/\nNUM: /[0-9]{1,2}/'
GRAMMAR_TEXT = r"[a-z]{2,3}=[0-9]{1,2}"  # what both grammars match


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("grammar", [GBNF, LARK], ids=["gbnf", "lark"])
def test_a_grammar_matches_whole(server, endpoint: str, grammar: str) -> None:
    texts = _texts(_post(server, endpoint, {"structured_outputs": {"grammar": grammar}, "n": 4, **SAMPLED}))
    assert all(reason == "stop" and re.fullmatch(GRAMMAR_TEXT, text) for text, reason in texts), texts


# A structural tag opened by a byte the random model writes often once biased towards it: every part from "@" to the
# closing "@" must be the schema's JSON, and the text between parts stays free.
TAG_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False, "x-guidance": {"whitespace_pattern": "[ ]{0,1}"}}
STRUCTURAL_TAG = {"type": "structural_tag", "triggers": ["@"],
                  "structures": [{"begin": "@", "schema": TAG_SCHEMA, "end": "@"}]}


@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_a_structural_tag_holds_each_tagged_part_and_leaves_the_rest_free(server, tiny_models, field: str) -> None:
    at = tiny_models[0].tokenizer.encode("@", add_special_tokens=False)[0]
    wanted = STRUCTURAL_TAG if field == "response_format" else {"structural_tag": json.dumps(STRUCTURAL_TAG)}
    body = {field: wanted, "n": 4, "temperature": 1.0, "seed": 7, "max_tokens": 160, "logit_bias": {str(at): 6}}
    texts = _texts(_post(server, "completions", body))
    parts = [part for text, _ in texts for part in text.split("@")[1:-1:2]]  # whole parts: between an opening @
    assert len(parts) >= 4, texts  # and its closing one, the output not cut inside
    for part in parts:
        jsonschema.validate(json.loads(part), TAG_SCHEMA)
    free = _texts(_post(server, "completions", body | {field: None} | (
        {"response_format": None} if field == "structured_outputs" else {})))
    tagged_free = [part for text, _ in free for part in text.split("@")[1:-1:2]]
    assert tagged_free and not all(_parses(part) for part in tagged_free), free  # without the tag: no JSON there


def _parses(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), TAG_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_streamed_chunks_join_to_the_whole_response(server) -> None:
    request = {"model": MODEL, "messages": CHAT, "response_format": JSON_SCHEMA, "temperature": 0,
               "max_tokens": MAX_TOKENS}
    sdk = _sdk(server)
    whole = sdk.chat.completions.create(**request)
    chunks = list(sdk.chat.completions.create(**request, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content and _valid(streamed)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


DEEP = _nested(200)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", "wat"),
    ({"structured_outputs": {"json": {"type": "wat"}}}, "structured_outputs", "wat"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "unclosed group"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{nope"}}}, "response_format", "not JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format", "JSON object"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be one of"),
    ({"response_format": "json_object"}, "response_format", "dictionary"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "cannot combine"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs", "neither Lark nor GBNF"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs", "structured_outputs: "),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs", "choice"),
    ({"guided_json": SCHEMA}, "guided_json", "structured_outputs"),
    ({"response_format": STRUCTURAL_TAG | {"triggers": ["<"]}}, "response_format", "none of the triggers"),
    ({"response_format": STRUCTURAL_TAG | {"structures": []}}, "response_format", "structures"),
    ({"structured_outputs": {"structural_tag": "{nope"}}, "structured_outputs", "not JSON"),
    ({"structured_outputs": {"structural_tag": {"triggers": ["@"], "structures": [
        {"begin": "@", "schema": {"type": "wat"}, "end": "@"}]}}}, "structured_outputs", "wat"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response format"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "response_format", "tool_choice"),
    # Past llguidance's recursion limit: its ValueError was a 500.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}, "response_format",
     "recursion limit"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs", "recursion limit"),
], ids=["schema-wat", "structured-json-wat", "structured-regex", "no-json-schema", "no-schema", "schema-text",
        "schema-list", "type-xml", "not-an-object", "both-fields", "structured-empty", "structured-two",
        "structured-grammar", "structured-lark", "choice-empty", "choice-number", "guided-json", "tag-trigger",
        "tag-empty", "tag-text", "tag-schema", "ignore-eos",
        "required-call", "schema-deep", "structured-deep"])
def test_bad_formats_are_400_naming_the_field(server, body: dict, param: str, says: str) -> None:
    response = _post(server, "chat/completions", {"max_tokens": 4} | body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(f"{param}: ") and says in error["message"], error["message"]


def test_a_structural_tags_bad_schema_is_named_in_one_line(server) -> None:
    """llguidance places the error in the grammar the tag was built into, which the client never wrote: the reason
    alone, without that grammar's lines."""
    tag = {"triggers": ["@"], "structures": [{"begin": "@", "schema": {"type": "wat"}, "end": "@"}]}
    response = _post(server, "chat/completions", {"max_tokens": 4, "structured_outputs": {"structural_tag": tag}})
    assert response.json()["error"]["message"] == "structured_outputs: failed to compile JSON schema: Invalid type: wat"


def test_a_bad_schema_is_refused_before_streaming(server) -> None:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
            "stream": True, "max_tokens": 4}
    response = _post(server, "completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


def test_a_bad_format_is_refused_before_the_engine_and_leaves_running_requests_alone(server) -> None:
    """The gateway compiles the format first: one that reached the workers would fail the step it was batched
    into, and with it the requests running beside it."""
    url = server.gateway.http_url
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generating now
        bad = _post(server, "completions", {"structured_outputs": {"json": {"type": "wat"}}, "max_tokens": 4})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" not in events[-1] and events[-1]["usage"]["completion_tokens"] == 2000
    assert server.wait_for(lambda: server.gateway.loop.active == 0 and server.caches_empty())


# Ambiguous: its parse costs more with every "a" (86 ms a token after 160 on CPU-A). No EOS before the "!" it ends with.
SLOW_GRAMMAR = 'start: e "!"\ne: e e | e e e | "a"'


def test_a_grammar_too_costly_to_follow_fails_its_request_alone(server, tiny_models) -> None:
    """The format compiles, so the gateway admits it; its masks grow costlier with every token, until the workers
    refuse that request (a 400 naming the field) while a request running beside it goes on to its last token."""
    url = server.gateway.http_url
    (bang,) = tiny_models[0].tokenizer.encode("!", add_special_tokens=False)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generating now
        slow = _post(server, "completions", {"structured_outputs": {"grammar": SLOW_GRAMMAR}, "max_tokens": 1000,
                                             "temperature": 0, "logit_bias": {str(bang): -100}})
        assert slow.status_code == 400, slow.text
        error = slow.json()["error"]
        assert error["param"] == "structured_outputs" and error["message"].startswith("structured_outputs: ")
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" not in events[-1] and events[-1]["usage"]["completion_tokens"] == 2000
    assert server.wait_for(lambda: server.gateway.loop.active == 0 and server.caches_empty())


def test_each_wire_case_through_the_client(server) -> None:
    with TandemClient(server.address, timeout=120) as client:
        schema = client.generate_result("Colour:", response_format=JSON_SCHEMA, n=4, **SAMPLED)
        assert [c.finish_reason for c in schema.choices] == ["stop"] * 4
        assert all(_valid(c.text) for c in schema.choices)
        regex = client.generate_result("Code:", response_format={"type": "regex", "regex": REGEX}, n=4, **SAMPLED)
        assert all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for c in regex.choices)
        grammar = client.generate_result("Code:", response_format={"type": "grammar", "grammar": GBNF}, n=4,
                                         **SAMPLED)
        assert all(c.finish_reason == "stop" and re.fullmatch(GRAMMAR_TEXT, c.text) for c in grammar.choices)
        anything = client.generate_result(chat=CHAT, response_format={"type": "json_object"}, n=4, **SAMPLED)
        stopped = [c.text for c in anything.choices if c.finish_reason == "stop"]
        assert stopped and all(isinstance(json.loads(text), dict) for text in stopped)
        with pytest.raises(grpc.RpcError) as raised:
            client.generate_result("x", max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("response_format: ")


@pytest.mark.parametrize(("wanted", "code", "details"), [
    (pb.ResponseFormat(json_object=False), grpc.StatusCode.INVALID_ARGUMENT, "response_format.json_object: "),
    (pb.ResponseFormat(regex="a{3,1}"), grpc.StatusCode.INVALID_ARGUMENT, "response_format: "),
    (pb.ResponseFormat(json_schema="[1, 2]"), grpc.StatusCode.INVALID_ARGUMENT, "response_format: "),
    (pb.ResponseFormat(json_schema="x" * (64 * 1024 + 1)), grpc.StatusCode.INVALID_ARGUMENT, "response_format: "),
    (pb.ResponseFormat(), grpc.StatusCode.OK, ""),  # no case set: free text
    (pb.ResponseFormat(regex="(ab)+"), grpc.StatusCode.OK, ""),
    (pb.ResponseFormat(grammar="hello world"), grpc.StatusCode.INVALID_ARGUMENT, "response_format: the grammar"),
    (pb.ResponseFormat(grammar='root ::= "ab" [0-9]'), grpc.StatusCode.OK, ""),
    (pb.ResponseFormat(structural_tag=json.dumps(STRUCTURAL_TAG)), grpc.StatusCode.OK, ""),
    (pb.ResponseFormat(structural_tag="{nope"), grpc.StatusCode.INVALID_ARGUMENT, "response_format: the structural"),
    (pb.ResponseFormat(structural_tag=json.dumps(STRUCTURAL_TAG | {"triggers": ["<"]})),
     grpc.StatusCode.INVALID_ARGUMENT, "response_format: structural_tag.structures[0].begin"),
], ids=["json-object-false", "bad-regex", "schema-not-object", "schema-too-long", "no-case", "regex", "bad-grammar",
        "grammar", "structural-tag", "structural-tag-text", "structural-tag-trigger"])
def test_the_raw_stub(server, wanted: pb.ResponseFormat, code: grpc.StatusCode, details: str) -> None:
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                        response_format=wanted))
    with grpc.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            items = list(stub.Generate(request, timeout=120))
        except grpc.RpcError as exc:
            assert exc.code() == code and exc.details().startswith(details), exc.details()
            return
    assert code == grpc.StatusCode.OK
    if wanted.regex or wanted.grammar:
        text = "".join(item.chunk.text for item in items if item.HasField("chunk"))
        assert re.fullmatch(wanted.regex or "ab[0-9]", text)
        assert items[-1].complete.finish_reason == pb.FINISH_REASON_STOP


def test_cli_generate_locally_and_through_a_gateway(server, tiny_dirs, tmp_path, capsys) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    local = ["generate", "Colour:", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
             "--dtype", "float32", "--fixed-k", "4", "--seed", "5", "--max-tokens", str(MAX_TOKENS), "--json"]
    assert main([*local, "--json-schema", f"@{schema_file}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and _valid(out["text"])
    remote = ["generate", "Code:", "--address", server.address, "--seed", "5", "--max-tokens", str(MAX_TOKENS)]
    assert main([*remote, "--regex", REGEX, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and re.fullmatch(REGEX, out["text"])
    assert main([*remote, "--json-schema", json.dumps(SCHEMA), "--json"]) == 0
    assert _valid(json.loads(capsys.readouterr().out)["text"])
    grammar_file = tmp_path / "grammar.gbnf"
    grammar_file.write_text(GBNF)
    for where in (local, remote):
        assert main([*where, "--grammar", f"@{grammar_file}", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["finish_reason"] == "stop" and re.fullmatch(GRAMMAR_TEXT, out["text"])
