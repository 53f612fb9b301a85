"""Tool calls with the real pair: `tandem serve --in-process` (`--dtype auto`: bf16 on a CPU with AVX512-BF16), 4 chats
that call for a tool, each offered the same 3 tools over gRPC, greedy, 128 tokens, with speculation (AUTO) and
without; what the gateway parsed out of each output (the calls, their arguments, the finish reason, the text left)
and whether the token ids agree between the two. Then the forced choices, with speculation: tool_choice "required" on
2 chats that need no tool, and a named tool ("function:NAME") on 2 chats: since the call's format masks what follows
the begun call (gateway.tools.call_format), each of these must come back as a call of an offered tool.

    PYTHONPATH=services python docs/bench/tools-real-v3.py tools.json     # about 5 min on CPU-A
"""
import json
import sys
import tempfile
from pathlib import Path

from tandem.bench.local_cluster import serve_process
from tandem.client import TandemClient

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "run_python", "description": "Run Python code and return its output",
                                      "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}},
    {"type": "function", "function": {"name": "search_files", "description": "Find files whose name matches a glob",
                                      "parameters": {"type": "object",
                                                     "properties": {"pattern": {"type": "string"},
                                                                    "directory": {"type": "string"}},
                                                     "required": ["pattern"]}}},
]
FORCED = [("Tell me a joke about compilers.", "required"), ("Say hello.", "required"),
          ("I am planning a trip to Rome.", "function:get_weather"),
          ("List what is in my project.", "function:search_files")]
CHATS = ["What is the weather in Lisbon right now?",
         "Compute the 30th Fibonacci number by running code.",
         "Find every Python test file under the tests directory.",
         "Is it raining in Osaka? Check, then tell me whether to take an umbrella."]

out = sys.argv[1]
flags = ["--target", "qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "--in-process",
         "--dtype", "auto"]
report = {"tools": [t["function"]["name"] for t in TOOLS], "max_tokens": 128, "chats": []}
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log") as (address, ready):
    report["ready_s"] = ready
    with TandemClient(address, timeout=600) as client:
        for chat in CHATS:
            row = {"chat": chat}
            for mode in ("auto", "off"):
                result = client.generate_result(chat=[("user", chat)], tools=TOOLS, temperature=0, max_tokens=128,
                                                speculation=mode)
                row[mode] = {"finish_reason": result.finish_reason, "text": result.text,
                             "calls": [{"name": c.name, "arguments": json.loads(c.arguments_json)}
                                       for c in result.choices[0].tool_calls],
                             "tokens": len(result.token_ids), "acceptance": result.speculation.acceptance_rate,
                             "token_ids": result.token_ids}
            row["same_tokens"] = row["auto"].pop("token_ids") == row["off"].pop("token_ids")
            report["chats"].append(row)
            print(json.dumps(row), flush=True)
        report["forced"] = []
        for chat, choice in FORCED:
            result = client.generate_result(chat=[("user", chat)], tools=TOOLS, tool_choice=choice, temperature=0,
                                            max_tokens=128)
            row = {"chat": chat, "tool_choice": choice, "finish_reason": result.finish_reason, "text": result.text,
                   "calls": [{"name": c.name, "arguments": json.loads(c.arguments_json)}
                             for c in result.choices[0].tool_calls]}
            report["forced"].append(row)
            print(json.dumps(row), flush=True)
report["calls_parsed"] = sum(bool(row["auto"]["calls"]) for row in report["chats"])
report["forced_calls_parsed"] = sum(bool(row["calls"]) for row in report["forced"])
report["same_tokens"] = sum(row["same_tokens"] for row in report["chats"])
print(json.dumps({k: v for k, v in report.items() if k not in ("chats", "forced")}))
with open(out, "w") as sink:
    json.dump(report, sink, indent=1)
