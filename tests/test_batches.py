"""The Batch API (/v1/files, /v1/batches) through the openai SDK against a real gateway over the tiny pair (float32,
greedy): a batch's answers are the ones the same requests get sent one by one; bad files are refused with their lines
named; listing pages through what a loop deletes; files expire when the client asks; cancel keeps what finished.
Across two gateways over one real Redis (a batch read, cancelled and taken on by the other replica), and a tenant's
bounded file storage: tests/test_batches_replicas.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from batches_harness import GREEDY, MODEL, _chat, _ended, _lines, _upload
from gateway_harness import ServerThread, openai_sdk, tiny_backend
from tandem.gateway.openai import files


def test_a_batch_answers_each_request_as_it_is_answered_alone(sdk) -> None:
    prompts = [f"def f{n}(x):" for n in range(6)]
    lines = [_chat(f"req-{n}", text) for n, text in enumerate(prompts)]
    lines.append(_chat("bad", "hi", temperature=-1))  # a request the API refuses: the error file has its answer
    lines.append({"custom_id": "text", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                           "n": 2, **GREEDY}})
    input_id = _upload(sdk, lines)
    batch = sdk.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 8 and batch.metadata == {"job": "nightly"}
    done = _ended(sdk, batch.id)
    assert done.status == "completed" and done.completed_at and done.finalizing_at
    assert (done.request_counts.completed, done.request_counts.failed) == (7, 1)
    outputs, errors = _lines(sdk, done.output_file_id), _lines(sdk, done.error_file_id)
    assert sorted(outputs) == sorted([f"req-{n}" for n in range(6)] + ["text"]) and list(errors) == ["bad"]
    for n, text in enumerate(prompts):
        alone = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True})
        answer = outputs[f"req-{n}"]["response"]
        assert answer["status_code"] == 200 and answer["request_id"]
        assert answer["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
        usage = answer["body"]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (alone.usage.prompt_tokens, 4)
    assert len(outputs["text"]["response"]["body"]["choices"]) == 2
    refused = errors["bad"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"

    files = {file.id: file for file in sdk.files.list()}
    assert files[input_id].purpose == "batch" and files[done.output_file_id].purpose == "batch_output"
    assert files[input_id].bytes == len(sdk.files.content(input_id).content)
    assert done.id in [listed.id for listed in sdk.batches.list()]
    sdk.files.delete(done.error_file_id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(done.error_file_id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(done.error_file_id)
    with pytest.raises(openai.BadRequestError):  # a finished batch cannot be cancelled
        sdk.batches.cancel(done.id)


def test_what_the_batch_api_refuses(sdk, server) -> None:
    bad = _upload(sdk, [_chat("a", "x"), "not json", _chat("a", "y"), {**_chat("c", "z"), "url": "/v1/completions"},
                        {**_chat("d", "z"), "body": {"stream": True}}, {"method": "POST"}, _chat("e", "half \ud800"),
                        '{"custom_id": "f", "body": ' + "[" * 2000 + "]" * 2000 + "}",
                        {**_chat("g", "z"), "body": {"background": True}}])
    failed = sdk.batches.create(input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h")
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"), (5, "invalid_body"),
        (6, "missing_required_parameter"), (7, "invalid_json_line"), (8, "invalid_json_line"),
        (9, "invalid_body")]
    assert failed.errors.data[-3].param == "body.messages[0].content"  # half a UTF-16 pair: no text to run
    assert failed.errors.data[-2].message == "This line nests arrays or objects too deeply."  # was a 500
    assert failed.errors.data[-1].param == "body.background"  # it ran on outside the batch
    good = _upload(sdk, [_chat("a", "x")])
    for fields, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"},
                                                                         "completion_window")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(**({"input_file_id": good, "endpoint": "/v1/chat/completions",
                                   "completion_window": "24h"} | fields))
        assert refused.value.body["param"] == param
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    assert unknown.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as purpose:
        sdk.files.create(file=("x.jsonl", b"{}\n"), purpose="assistants")
    assert purpose.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError):
        sdk.files.create(file=("x.bin", b"\xff\xfe"), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.retrieve("batch_nope")


def test_ids_that_name_what_a_record_refers_to_find_nothing(sdk, server) -> None:
    """A tenant's index of its files was reachable as the file `%00file-index`: deleting it unlisted every file and
    lifted the quota; `%00batch-index`, a file's content and another batch's output were 500s or took as objects."""
    url = f"{server.gateway.http_url}/v1"
    done = _ended(sdk, sdk.batches.create(input_file_id=_upload(sdk, [_chat("a", "x")]),
                                          endpoint="/v1/chat/completions", completion_window="24h").id)
    listed = {file.id for file in sdk.files.list()}
    for name in ("%00file-index", "%00batch-index", "x%00"):
        for method, path in (("GET", f"files/{name}"), ("DELETE", f"files/{name}"), ("GET", f"files/{name}/content"),
                             ("GET", f"batches/{name}"), ("POST", f"batches/{name}/cancel")):
            answer = httpx.request(method, f"{url}/{path}", timeout=10)
            assert answer.status_code == 404, (method, path, answer.text)
    for path in ("responses/%00x", "conversations/%00x", "responses/%00x/input_items"):  # ids are printable
        assert httpx.get(f"{url}/{path}", timeout=10).status_code == 404
    for name in ("\0file-index", f"{done.input_file_id}/content"):
        with pytest.raises(openai.NotFoundError):
            sdk.batches.create(input_file_id=name, endpoint="/v1/chat/completions", completion_window="24h")
    assert {file.id for file in sdk.files.list()} == listed  # nothing unlisted
    with pytest.raises(openai.BadRequestError) as output:  # another batch's output is no batch's input
        sdk.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert output.value.body["param"] == "input_file_id" and "batch_output" in output.value.body["message"]


def test_a_loop_deleting_what_it_lists_goes_through_every_page(tiny_models) -> None:
    """`for f in client.files.list(): client.files.delete(f.id)`: the SDK asks for the next page after the last id of
    the one before, deleted by then, which was a 400 ("nothing listed has the id") after the first page."""
    target, draft, _ = tiny_models
    gateway = ServerThread(tiny_backend(target, draft), http_port=0)
    try:
        sdk = openai_sdk(gateway)
        for order, count in (("desc", 45), ("asc", 25)):  # newest first (the default), then oldest first
            made = [sdk.files.create(file=(f"{n}.jsonl", b"{}\n"), purpose="batch").id for n in range(count)]
            assert made == sorted(made)  # ids sort as they were made
            seen = []
            for file in sdk.files.list(order=order, limit=10):
                seen.append(file.id)
                sdk.files.delete(file.id)
            assert seen == (made[::-1] if order == "desc" else made)
            assert sdk.files.list().data == []
        made = [sdk.files.create(file=(f"{n}.jsonl", b"{}\n"), purpose="batch").id for n in range(30)]
        assert [file.id for file in sdk.files.list(order="asc").data] == made  # OpenAI's default page: 10,000
        assert len(sdk.files.list(limit=10_000).data) == 30
    finally:
        gateway.stop()


def test_files_and_a_batchs_output_expire_when_the_client_asks(sdk, monkeypatch) -> None:
    def after(seconds: int) -> dict:
        return {"anchor": "created_at", "seconds": seconds}

    kept = sdk.files.create(file=("a.jsonl", b'{"x": 1}\n'), purpose="batch", expires_after=after(7200))
    assert kept.expires_at == kept.created_at + 7200
    for seconds, words in ((60, "between 3600 and"), (30 * 24 * 3600, "this server keeps files")):
        with pytest.raises(openai.BadRequestError, match=words):
            sdk.files.create(file=("b.jsonl", b'{"x": 1}\n'), purpose="batch", expires_after=after(seconds))
    file_id = _upload(sdk, [_chat("one", "2 + 2 =")])
    with pytest.raises(openai.BadRequestError, match=r"output_expires_after\.seconds"):
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                           output_expires_after=after(10))
    batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                               output_expires_after=after(3600))
    output = sdk.files.retrieve(_ended(sdk, batch.id).output_file_id)
    assert output.expires_at == output.created_at + 3600
    # Past its expires_at a file is gone: not read, not listed, its content a 404 too.
    later = time.time() + 7201
    monkeypatch.setattr(files, "time", SimpleNamespace(time=lambda: later))
    for gone in (kept.id, output.id):
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(gone)
    listed = [file.id for file in sdk.files.list(limit=100)]
    assert kept.id not in listed and output.id not in listed and file_id in listed


def test_cancel_keeps_what_finished_and_stops_the_rest(sdk, server) -> None:
    lines = [_chat(f"long-{n}", "def add(a, b):", max_tokens=400) for n in range(24)]
    batch = sdk.batches.create(input_file_id=_upload(sdk, lines), endpoint="/v1/chat/completions",
                               completion_window="24h")
    deadline = time.monotonic() + 60
    while sdk.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert sdk.batches.cancel(batch.id).status == "cancelling"
    done = _ended(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    finished = _lines(sdk, done.output_file_id)
    assert 1 <= len(finished) == done.request_counts.completed < 24 and done.request_counts.failed == 0
    assert all(len(line["response"]["body"]["choices"][0]["message"]["content"]) for line in finished.values())
    deadline = time.monotonic() + 10
    while server.gateway.loop.active and time.monotonic() < deadline:
        time.sleep(0.02)
    # (the engine thread frees a cancelled request's caches just after the loop lets it go)
    assert server.gateway.loop.active == 0 and server.wait_for(server.caches_empty)
