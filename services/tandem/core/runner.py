"""Runs a Hugging Face causal LM over many sequences, each with its own KV cache that can be rolled back.

Each sequence owns a DynamicCache. A finished sequence of a session may be retained (bounded, least recently used
first out) so the session's next request reuses the cache of their common prefix: a chat's next turn starts with
the whole previous conversation. A batch of sequences with different cached lengths and different numbers of
new tokens runs as one forward: caches are left-padded into a batch cache, new tokens right-padded, positions
given explicitly, and each row's slice is cut back out afterwards. A batch of one uses its cache in place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

SHORT_FORWARD = 16
DEFAULT_RETAIN_TOKENS = 32768


@dataclass(slots=True)
class SequenceState:
    """Tokens a runner knows for one sequence; the first `cached` of them have keys and values in `cache`."""

    tokens: list[int] = field(default_factory=list)
    cache: DynamicCache = field(default_factory=DynamicCache)
    cached: int = 0
    generator: torch.Generator | None = None
    session: str = ""

    def sync(self, keep: int, append: list[int]) -> None:
        """Truncate to the first `keep` tokens, then append new ones; cached tokens past `keep` that `append`
        repeats stay cached, the rest are rolled back."""
        if keep > len(self.tokens):
            raise ValueError(f"cannot keep {keep} tokens of a sequence that has {len(self.tokens)}")
        stale = self.tokens[keep : self.cached]
        del self.tokens[keep:]
        self.tokens.extend(append)
        if self.cached > keep:
            same = next((i for i, (a, b) in enumerate(zip(stale, append, strict=False)) if a != b),
                        min(len(stale), len(append)))
            if keep + same < self.cached:
                self.truncate_cache(keep + same)

    def truncate_cache(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self.cached = length

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cached :]


class ModelRunner:
    """Owns one model and the per-sequence states that run on it."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int = 0, vocab_limit: int = 0,
                 retain_tokens: int = DEFAULT_RETAIN_TOKENS) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        # Logits are computed here rather than by the model, optionally for only the first `vocab_limit` ids,
        # without touching the shared model.
        self.head_module = model.get_output_embeddings()
        self.head = None  # a sliced projection; None calls the model's own head (which may be tensor-parallel)
        if 0 < vocab_limit < self.vocab_size:
            self.head = self.head_module.weight[:vocab_limit]
            self.vocab_size = vocab_limit
        self.pad_token_id = pad_token_id
        self.states: dict[str, SequenceState] = {}
        self.retain_tokens = retain_tokens
        self.retained: OrderedDict[str, SequenceState] = OrderedDict()  # session -> its last finished sequence
        self.reused_tokens = 0

    def state(self, seq_id: str, session: str = "") -> SequenceState:
        """The state of `seq_id`; a new one starts from its session's retained cache when there is one."""
        if seq_id not in self.states:
            state = self.retained.pop(session, None) if session else None
            if state is None:
                state = SequenceState(session=session)
            state.generator = None
            self.states[seq_id] = state
        return self.states[seq_id]

    def release(self, seq_id: str, retain: bool = False) -> None:
        """Drop a sequence; with `retain`, keep its cache for its session's next request."""
        state = self.states.pop(seq_id, None)
        if state is None or not (retain and state.session and state.cached):
            return
        self.retained.pop(state.session, None)
        self.retained[state.session] = state
        while sum(s.cached for s in self.retained.values()) > self.retain_tokens:
            self.retained.popitem(last=False)

    @property
    def cached_tokens(self) -> int:
        return sum(state.cached for state in self.states.values())

    @torch.inference_mode()
    def prefill(self, state: SequenceState, upto: int) -> None:
        """Cache the first `upto` tokens without keeping logits (prompt processing)."""
        if upto > state.cached:
            self._forward_one(state, state.tokens[state.cached : upto], want=0)

    @torch.inference_mode()
    def forward(self, states: list[SequenceState], wants: list[int]) -> list[torch.Tensor]:
        """Feed every state's pending tokens; return the logits [want_i, V] of each row's last want_i tokens."""
        if len(states) == 1:
            return [self._forward_one(states[0], states[0].pending, wants[0])]
        return self._forward_batch(states, wants)

    def _forward_one(self, state: SequenceState, new: list[int], want: int) -> torch.Tensor:
        start = state.cached
        ids = torch.tensor([new], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(new), device=self.device).unsqueeze(0)
        logits, cache = self._run(input_ids=ids, position_ids=positions, past_key_values=state.cache, want=want)
        state.cache = cache
        state.cached = start + len(new)
        return logits[0, -want:].float().cpu() if want else logits

    def _forward_batch(self, states: list[SequenceState], wants: list[int]) -> list[torch.Tensor]:
        news = [state.pending for state in states]
        past = [state.cached for state in states]
        past_max, new_max = max(past), max(len(n) for n in news)
        batch = len(states)
        ids = torch.full((batch, new_max), self.pad_token_id, dtype=torch.long)
        mask = torch.ones(batch, past_max + new_max, dtype=torch.long)
        positions = torch.zeros(batch, new_max, dtype=torch.long)
        for row, (new, cached) in enumerate(zip(news, past, strict=True)):
            ids[row, : len(new)] = torch.tensor(new, dtype=torch.long)
            mask[row, : past_max - cached] = 0
            positions[row] = torch.arange(cached, cached + new_max)
        cache = self._stack_caches(states, past_max) if past_max else DynamicCache()
        logits, cache = self._run(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  position_ids=positions.to(self.device), past_key_values=cache, want=None)
        results = []
        for row, (state, new, cached, want) in enumerate(zip(states, news, past, wants, strict=True)):
            lo, hi = past_max - cached, past_max + len(new)
            state.cache = DynamicCache(ddp_cache_data=[
                (layer.keys[row : row + 1, :, lo:hi], layer.values[row : row + 1, :, lo:hi])
                for layer in cache.layers
            ])
            state.cached = cached + len(new)
            results.append(logits[row, len(new) - want : len(new)].float().cpu())
        return results

    def _run(self, want: int | None, **inputs) -> tuple[torch.Tensor, DynamicCache]:
        """The model's forward, then logits for every position (want None) or the last `want` (0: no logits)."""
        out = self.model.base_model(**inputs, use_cache=True)
        if want == 0:
            return torch.empty(0), out.past_key_values
        hidden = out.last_hidden_state
        # Short forwards score every position: that is cheap, and keeps logits for all draft positions.
        if want is not None and hidden.shape[1] > SHORT_FORWARD:
            # A fresh, densely strided copy: on CPU bf16 (torch 2.13), the output projection of a slice with the
            # parent's strides took 0.7 s against 0.01 s for a copy (Qwen2.5-0.5B head, one row).
            hidden = hidden[:, -want:].clone(memory_format=torch.contiguous_format)
        logits = self.head_module(hidden) if self.head is None else torch.nn.functional.linear(hidden, self.head)
        return logits, out.past_key_values

    @staticmethod
    def _stack_caches(states: list[SequenceState], length: int) -> DynamicCache:
        reference = next(state.cache for state in states if state.cached)
        layers = []
        for index, ref_layer in enumerate(reference.layers):
            keys, values = [], []
            for state in states:
                if state.cached:
                    key, value = state.cache.layers[index].keys, state.cache.layers[index].values
                else:
                    key = value = ref_layer.keys.new_zeros((1, *ref_layer.keys.shape[1:2], 0, ref_layer.keys.shape[-1]))
                pad = length - state.cached
                keys.append(torch.nn.functional.pad(key, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(value, (0, 0, pad, 0)))
            layers.append((torch.cat(keys), torch.cat(values)))
        return DynamicCache(ddp_cache_data=layers)
