"""OpenAI's Responses API with the real pair, through the openai SDK against `tandem serve --in-process` over HTTP.

1. The 8 shipped prompts, greedy, 96 tokens, speculation AUTO: each through chat.completions, responses.create
   (whole) and the SDK's responses.stream helper (which rebuilds the response from the events), the order rotated
   prompt by prompt: the same text each way, the same token counts, and each request's seconds (the ratio of the
   Responses API's to the chat API's, within this run).
2. An agent's loop, as the SDK documents it: 4 requests that call for one of 3 offered function tools; the output
   items are appended to the input with a made-up function_call_output, and the model asked again; what it called,
   with which arguments, whether its answer uses the tool's output, and whether the chat API, sent the same
   conversation as messages, gives the same answer from the same prompt.

    PYTHONPATH=services python docs/bench/responses-api-v1.py float32 responses.json     # about 10 min on CPU-A
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import openai

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "run_python", "description": "Run Python code and return its output",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
    {"type": "function", "name": "search_files", "description": "Find files whose name matches a glob",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "directory": {"type": "string"}},
                    "required": ["pattern"]}},
]
# (request, the output the called tool "returns", a word the answer should then contain)
AGENT = [("What is the weather in Lisbon right now?", "Lisbon: 17 C, light rain", "17"),
         ("Compute the 30th Fibonacci number by running code.", "832040", "832040"),
         ("Find every Python test file under the tests directory.", "tests/test_a.py\ntests/test_b.py", "test_a"),
         ("Is it raining in Osaka? Check, then tell me whether to take an umbrella.", "Osaka: 22 C, heavy rain",
          "umbrella")]
dtype, out = sys.argv[1], sys.argv[2]


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def three_ways(sdk: openai.OpenAI, prompt: str, order: list[str]) -> dict:
    greedy = {"temperature": 0, "extra_body": {"speculation": "auto"}}
    ways = {
        "chat": lambda: sdk.chat.completions.create(model=TARGET, max_tokens=96, messages=[
            {"role": "user", "content": prompt}], **greedy),
        "responses": lambda: sdk.responses.create(model=TARGET, input=prompt, max_output_tokens=96, **greedy),
        "stream": lambda: streamed(sdk, prompt, greedy)}
    row = {}
    for way in order:
        result, seconds = timed(ways[way])
        if way == "chat":
            row[way] = {"text": result.choices[0].message.content, "tokens": result.usage.completion_tokens,
                        "s": round(seconds, 3), "speculation": result.choices[0].model_extra["tandem"]["speculation"]}
        else:
            row[way] = {"text": result.output_text, "tokens": result.usage.output_tokens, "status": result.status,
                        "s": round(seconds, 3), "speculation": result.model_extra["tandem"]["speculation"]}
    return row


def streamed(sdk: openai.OpenAI, prompt: str, greedy: dict):
    """The SDK's stream helper; a response cut at max_output_tokens ends in response.incomplete, which the helper
    does not take as an end (it waits for response.completed), so that one is rebuilt from the events here."""
    with sdk.responses.stream(model=TARGET, input=prompt, max_output_tokens=96, **greedy) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == last.response.output_text, "the deltas do not join into the final response's text"
    return last.response


def agent_turn(sdk: openai.OpenAI, request: str, tool_output: str, word: str) -> dict:
    items: list = [{"role": "user", "content": request}]
    first = sdk.responses.create(model=TARGET, input=items, tools=TOOLS, max_output_tokens=128, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    row = {"request": request, "first_status": first.status, "first_text": first.output_text,
           "calls": [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]}
    if not calls:
        return row
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": tool_output} for c in calls]
    second = sdk.responses.create(model=TARGET, input=items, tools=TOOLS, max_output_tokens=128, temperature=0)
    messages = [{"role": "user", "content": request},
                {"role": "assistant", "content": first.output_text, "tool_calls": [
                    {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]},
                *({"role": "tool", "tool_call_id": c.call_id, "content": tool_output} for c in calls)]
    chat = sdk.chat.completions.create(model=TARGET, messages=messages, max_tokens=128, temperature=0, tools=[
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS])
    again = [{"name": c.name, "arguments": c.arguments} for c in second.output if c.type == "function_call"]
    return row | {"answer": second.output_text, "answer_calls": again, "answer_status": second.status,
                  "answer_uses_output": word.lower() in second.output_text.lower(),
                  "answer_input_tokens": second.usage.input_tokens,
                  "chat_same_prompt": chat.usage.prompt_tokens == second.usage.input_tokens,
                  "chat_same_answer": (chat.choices[0].message.content or "") == second.output_text and [
                      {"name": c.function.name, "arguments": c.function.arguments}
                      for c in chat.choices[0].message.tool_calls or ()] == again}


port = free_port()
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process", "--dtype", dtype]
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port) as (_, ready_s):
    report = {"dtype": dtype, "max_tokens": 96, "ready_s": ready_s, "prompts": []}
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
    ways = ["chat", "responses", "stream"]
    for index, prompt in enumerate(load_prompts()):
        order = ways[index % 3:] + ways[: index % 3]
        row = three_ways(sdk, prompt, order) | {"order": order}
        row["same_text"] = row["chat"]["text"] == row["responses"]["text"] == row["stream"]["text"]
        report["prompts"].append(row)
        print(json.dumps({k: row[k] for k in ("order", "same_text")} | {
            w: {k: v for k, v in row[w].items() if k not in ("text", "speculation")} for w in ways}), flush=True)
    report["agent"] = [agent_turn(sdk, *case) for case in AGENT]
    for row in report["agent"]:
        print(json.dumps(row), flush=True)

rows = report["prompts"]
seconds = {way: sum(row[way]["s"] for row in rows) for way in ("chat", "responses", "stream")}
report["summary"] = {
    "same_text": sum(row["same_text"] for row in rows), "prompts": len(rows),
    "same_tokens": sum(row["chat"]["tokens"] == row["responses"]["tokens"] == row["stream"]["tokens"] for row in rows),
    "seconds": {way: round(s, 2) for way, s in seconds.items()},
    "responses_over_chat": round(seconds["responses"] / seconds["chat"], 3),
    "stream_over_chat": round(seconds["stream"] / seconds["chat"], 3),
    "agent_calls": sum(bool(row["calls"]) for row in report["agent"]),
    "agent_answers_use_output": sum(bool(row.get("answer_uses_output")) for row in report["agent"]),
    "agent_chat_same_answer": sum(bool(row.get("chat_same_answer")) for row in report["agent"])}
Path(out).write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report["summary"]))
