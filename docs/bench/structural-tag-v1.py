"""vLLM's structural_tag with the real pair: `tandem serve --in-process` (bf16 on CPU-A, AUTO), chats asking for tool
calls in Llama-3.1's own markup (`<function=NAME>{json}</function>`, which Qwen2.5's template does not show), greedy,
192 tokens, each asked free and with a structural tag per tool (trigger `<function=`), which one first alternating.
Per request: the tagged parts written, how many parse as their tool's arguments, the text, seconds.

    PYTHONPATH=services python docs/bench/structural-tag-v1.py docs/bench/structural-tag-v1.json   # ~5 min on CPU-A
"""
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema

from tandem.bench.local_cluster import serve_process
from tandem.sessions.embedded import free_port

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False},
         "convert": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                      "to": {"type": "string"}},
                     "required": ["amount", "from", "to"], "additionalProperties": False}}
SYSTEM = ("You can call these functions: get_weather(city: string) and convert(amount: number, from: string, to: "
          "string) for currencies. To call one, write <function=NAME>{JSON arguments}</function> and nothing else, "
          "one call per line.")
CHATS = ["What's the weather in Lisbon?", "Convert 120 euros to yen.", "Weather in Oslo and in Cairo, please.",
         "How many dollars is 75 pounds?", "Is it raining in Tokyo right now?", "Turn 10 francs into euros."]
TAG = {"type": "structural_tag", "triggers": ["<function="],
       "structures": [{"begin": f"<function={name}>", "schema": schema, "end": "</function>"}
                      for name, schema in TOOLS.items()]}
CALL = re.compile(r"<function=([^>]*)>(.*?)</function>", re.S)
MAX_TOKENS = 192


def ask(url: str, chat: str, tagged: bool) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": chat}],
            "temperature": 0, "max_tokens": MAX_TOKENS} | ({"response_format": TAG} if tagged else {})
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    seconds = time.perf_counter() - started
    assert response.status_code == 200, response.text
    answer = response.json()
    text = answer["choices"][0]["message"]["content"]
    calls = CALL.findall(text)
    return {"text": text, "calls": len(calls), "valid": sum(_valid(name, arguments) for name, arguments in calls),
            "opened": text.count("<function="), "finish_reason": answer["choices"][0]["finish_reason"],
            "completion_tokens": answer["usage"]["completion_tokens"], "seconds": round(seconds, 3)}


def _valid(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), TOOLS[name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


port = free_port()
flags = ["--target", "qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "--in-process",
         "--dtype", "auto"]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port):
    url = f"http://127.0.0.1:{port}"
    ask(url, "Say hello.", False)  # warm-up
    for index, chat in enumerate(CHATS):
        order = (False, True) if index % 2 == 0 else (True, False)
        row = {"chat": chat} | {("tagged" if tagged else "free"): ask(url, chat, tagged) for tagged in order}
        rows.append(row)
        print(json.dumps({"chat": chat} | {way: [row[way][k] for k in ("opened", "calls", "valid")]
                                           for way in ("free", "tagged")}), flush=True)

summary = {way: {key: sum(row[way][key] for row in rows) for key in ("opened", "calls", "valid", "completion_tokens")}
           for way in ("free", "tagged")}
Path(sys.argv[1]).write_text(json.dumps({"max_tokens": MAX_TOKENS, "rows": rows, "summary": summary}, indent=1)
                             + "\n")
print(json.dumps(summary))
