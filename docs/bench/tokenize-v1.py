"""vLLM's /tokenize and /detokenize with the real target, against transformers' own tokenizer on the model's files:
the 8 shipped prompts as chats (`apply_chat_template` with the assistant's turn opened) and as raw prompts, a chat
with a tool offered, and each chat's `usage.prompt_tokens` from a real one-token request; then /detokenize of every
raw prompt's ids back to its text.

    PYTHONPATH=services python docs/bench/tokenize-v1.py t.json     # ~3 min on CPU-A
"""
import json
import sys
import tempfile
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tandem.bench.local_cluster import serve_process
from tandem.bench.prompts import load_prompts
from tandem.models.loader import resolve
from tandem.sessions.embedded import free_port

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
TOOL = {"type": "function", "function": {"name": "run_python", "description": "Run Python code",
                                         "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                        "required": ["code"]}}}
out = sys.argv[1]
reference = AutoTokenizer.from_pretrained(resolve(TARGET, progress=False).path)
port = free_port()
flags = ["--target", TARGET, "--draft", DRAFT, "--in-process"]
rows = []
with tempfile.TemporaryDirectory() as scratch, serve_process(flags, Path(scratch) / "serve.log", timeout_s=1800,
                                                             http_port=port):
    url = f"http://127.0.0.1:{port}"
    for prompt in load_prompts():
        chat = [{"role": "user", "content": prompt}]
        ours = httpx.post(f"{url}/tokenize", json={"messages": chat}, timeout=60).json()["tokens"]
        theirs = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        with_tool = httpx.post(f"{url}/tokenize", json={"messages": chat, "tools": [TOOL]}, timeout=60).json()
        theirs_tool = reference.apply_chat_template(chat, tools=[TOOL], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
        raw = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"]
        text = httpx.post(f"{url}/detokenize", json={"tokens": raw}, timeout=60).json()["prompt"]
        usage = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "messages": chat, "max_tokens": 1, "temperature": 0}).json()["usage"]["prompt_tokens"]
        rows.append({"prompt": prompt[:60], "chat_same": ours == list(theirs), "tool_same": with_tool["tokens"] == list(
            theirs_tool), "raw_same": raw == reference.encode(prompt, add_special_tokens=False),
            "detokenized_same": text == prompt, "usage_same": usage == len(ours), "chat_tokens": len(ours)})
        print(json.dumps(rows[-1]), flush=True)
summary = {key: sum(row[key] for row in rows) for key in ("chat_same", "tool_same", "raw_same", "detokenized_same",
                                                         "usage_same")} | {"prompts": len(rows)}
Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
print(json.dumps(summary))
