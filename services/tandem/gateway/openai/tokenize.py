"""vLLM's /tokenize, /detokenize and /tokenizer_info beside the OpenAI API: the target tokenizer's ids for a prompt or
a chat, the text of ids, and what a client needs to tokenize as the server does (its special tokens, chat template),
so that clients written for vLLM (lm-eval's remote tokenizer) count and build prompts against tandem unchanged.

/tokenize gives by default the ids a request would be given: a prompt's as /v1/completions encodes it, a chat's with
its template applied and the assistant's turn opened (the tools shown, as /v1/chat/completions shows them), through
the gateway's own tokenize path (gRPC's Tokenize). As in vLLM, `add_special_tokens: false` leaves out what the
tokenizer adds around a prompt (a BOS), and `add_generation_prompt: false` the assistant's opened turn; a chat's
special tokens are its template's own, whatever `add_special_tokens` says.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import StrictBool, StrictInt

from tandem.gateway.generation import Generations
from tandem.gateway.openai.convert import chat_request
from tandem.gateway.openai.errors import bad_request
from tandem.gateway.openai.schemas import ChatCompletionRequest, ChatMessage, ToolSpec, TrueFlag, _Body

RENAMES = {"chat.messages": "messages", "chat.tools": "tools", "chat": "messages", "input": "prompt"}


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolSpec] | None = None
    add_generation_prompt: TrueFlag = True
    add_special_tokens: TrueFlag = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


async def tokenize(generations: Generations, body: TokenizeRequest, tenant: str) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt: send exactly one of prompt or messages", "prompt")
    if body.prompt == "":  # (the engine's message names its own fields, prompt or chat)
        raise bad_request("prompt: must not be empty", "prompt")
    if body.messages is not None:
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
        ids = await generations.tokenize(chat=chat_request(chat, "tokenize").chat, tenant=tenant,
                                         generation_prompt=body.add_generation_prompt)
    else:
        ids = await generations.tokenize(prompt=body.prompt, tenant=tenant, special_tokens=body.add_special_tokens)
    texts = None
    if body.return_token_strs:
        texts = generations.tokenizer.convert_ids_to_tokens(ids)
    return {"count": len(ids), "max_model_len": generations.model_limits.context_window, "tokens": ids,
            "token_strs": texts}


async def tokenizer_info(generations: Generations) -> dict[str, Any]:
    """GET /tokenizer_info: the target tokenizer's special tokens, chat template and the context length (vLLM's
    endpoint, which lm-eval's remote tokenizer reads first); only these fields, not the tokenizer's whole config."""
    tokenizer = generations.tokenizer
    named = {name: getattr(tokenizer, name, None) for name in ("eos_token", "bos_token", "pad_token", "unk_token")}
    return {"tokenizer_class": type(tokenizer).__name__, **{k: v if isinstance(v, str) else None
                                                          for k, v in named.items()},
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": generations.model_limits.context_window,
            "vocab_size": generations.model_limits.vocab_size}


async def detokenize(generations: Generations, body: DetokenizeRequest, tenant: str) -> dict[str, Any]:
    """`tenant` is taken for symmetry with tokenize: decoding touches no per-tenant state."""
    vocab = generations.model_limits.vocab_size
    for index, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"tokens[{index}]: {token} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": await asyncio.to_thread(generations.tokenizer.decode, body.tokens)}  # (a 4 MB body: 0.3 s)
