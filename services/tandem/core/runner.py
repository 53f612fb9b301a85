"""Runs a Hugging Face causal LM over many sequences whose keys and values live in one preallocated cache.

Every sequence holds a slot of the runner's SlotCache (core.kv_cache; which sequence holds which slot, what is
retained and the KV budget: core.slots). The sequences being run hold the slots [0, active), so a forward over all
of them reads one view of the cache. A forward over some of them reads the range from the lowest to the highest of
their slots; the others in between run as padding rows that write nothing (a drafter's rows that stop drafting
early, a verifier's rows still prefilling).
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from tandem.core import cpu_attention
from tandem.core.attention import SEGMENTS, forward_lock, packed
from tandem.core.cuda_graphs import MAX_WIDTH, ROW_BUCKETS, GraphedForward
from tandem.core.device import on_device
from tandem.core.kv_cache import SlotCache, Step, cache_keyword, default_kv_tokens
from tandem.core.model_options import DEFAULT_RETAIN_TOKENS
from tandem.core.protocol import KVCacheFull
from tandem.core.row_inputs import packed_inputs, padded_inputs
from tandem.core.row_layout import RowLayout
from tandem.core.sequence import SequenceState
from tandem.core.slots import SlotTable

log = logging.getLogger(__name__)
ATTENTION = {"sdpa": True, "eager": False}  # implementations whose masks we build -> whether is_causal is honoured


class ModelRunner(SlotTable):
    """Owns one model and the cache of its sequences (which sequence holds which slot: core.slots)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int = 0, vocab_limit: int = 0,
                 retain_tokens: int = DEFAULT_RETAIN_TOKENS, kv_tokens: int = 0, cuda_graphs: bool = True,
                 compile: bool | None = None, prefix_cache: bool = True) -> None:
        """`kv_tokens`: the KV token budget (slots x capacity); 0 takes a share of the memory free now.
        `cuda_graphs`: replay decode forwards as CUDA graphs (core.cuda_graphs) on a GPU, outside tensor parallel.
        `compile`: those forwards compiled by torch.compile first (None: wherever CUDA graphs run); on a CPU, True
        runs the same compiled static forwards without graphs. `prefix_cache`: new sequences copy the cache of a
        prefix they share with one held here rather than compute it."""
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        implementation = model.config._attn_implementation or "sdpa"
        if implementation not in ATTENTION:
            raise ValueError(f"attention {implementation!r} is not supported: load the model with sdpa or eager")
        text_config = model.config.get_text_config()
        if "sliding_attention" in (getattr(text_config, "layer_types", None) or ()):
            # Our 4D masks replace the sliding-window masks transformers would build: such layers would see too much.
            raise ValueError("sliding-window attention layers are not supported by the slot KV cache")
        self.causal_kernel = ATTENTION[implementation]
        if self.causal_kernel:
            cpu_attention.prepare(self.device, self.dtype)  # built here, once per machine: no forward waits for it
        self.mask_dtype = torch.bool if self.causal_kernel else self.dtype
        self.vocab_size = int(model.config.vocab_size)
        positions = getattr(text_config, "max_position_embeddings", None)
        # Logits are computed here rather than by the model, optionally for only the first `vocab_limit` ids,
        # without touching the shared model.
        # The model's own head may be tensor-parallel, prepacked (core.packed_linear) or quantized (core.int8_linear,
        # core.w8a8_linear, core.w4_linear): the last ones slice themselves.
        self.head = model.get_output_embeddings()
        if 0 < vocab_limit < self.vocab_size:
            self.head = (self.head.first_rows(vocab_limit) if hasattr(self.head, "first_rows")
                         else partial(torch.nn.functional.linear, weight=self.head.weight[:vocab_limit]))
            self.vocab_size = vocab_limit
        self.pad_token_id = pad_token_id
        budget = kv_tokens or default_kv_tokens(model)
        # The most tokens one sequence may hold here: the model's positions, or the KV budget where it holds fewer (a
        # sequence alone always fits the budget: _fit), so a request that could never run is refused before it starts.
        self.context_window = min(positions, budget) if isinstance(positions, int) and positions > 0 else budget
        sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
        graphed = cuda_graphs and self.device.type == "cuda" and not sharded
        compiled = graphed if compile is None else compile and not sharded and (graphed or self.device.type == "cpu")
        static = graphed or compiled
        # Static forwards serve the batched steps of sdpa models only (boolean masks; GraphedForward.run).
        bucketed = static and self.mask_dtype == torch.bool
        self.layout = RowLayout(self.device.type, can_pack=self.causal_kernel,
                                padded_up_to=MAX_WIDTH if bucketed else 0, row_buckets=ROW_BUCKETS if bucketed else ())
        SlotTable.__init__(self, SlotCache(text_config.num_hidden_layers, margin=MAX_WIDTH if static else 0),
                           budget, retain_tokens, prefix_cache)
        self.cache_keyword = cache_keyword(model.base_model)
        self.graphs = GraphedForward(self.cache, self._hidden, compile=compiled, capture=graphed) if static else None
        self._model_lock = forward_lock(model)  # other runners over this model object wait while it runs (attention)

    @torch.inference_mode()
    def warm_up(self, progress: bool | None = None) -> int:
        """Compile the static forwards now rather than in a request: with dynamic shapes one compile serves each
        class of bucket, and on a GPU each takes tens of seconds. The classes: a cache of one slot (dynamo
        specializes a size of 1; a lone first request, or a budget that fits one slot at the length a sequence
        needs) with one row, then a cache of several slots with 1 or 2 rows; each at width 1 and above. Runs the six
        over throwaway sequences; returns the forwards run (0 where nothing compiles). `progress`: a bar on stderr
        (None: where stderr is a terminal, as calibration's; minutes pass between its steps on a CPU)."""
        if self.graphs is None or not self.graphs.compiled:
            return 0
        started = time.perf_counter()
        name = type(self.model).__name__
        log.info("compiling %s's decode forwards (six shape classes: about a minute each on a GPU, one to two on a "
                 "2-core CPU; less from a kept cache)", name)
        runs = 0
        names = [f"warm-up-{row}" for row in range(2)]
        bar = tqdm(total=6, desc=f"compiling {name}", unit="shape", disable=None if progress is None else not progress,
                   leave=False)
        try:
            if not self.states and not self.retained and self.cache.slots > 1:
                self.cache.reshape(1, self.cache.capacity)
                self.occupants = self.occupants[:1]
            for rows in (1, 1, 2):  # the first pass over a one-slot cache, the others after it grows
                states = [self.state(name) for name in names[:rows]]
                for state in states:
                    if not state.cached:
                        state.sync(0, [self.pad_token_id] * 4)
                        self.prefill(state, 4)
                for width in (1, 2):
                    for state in states:
                        state.sync(len(state.tokens), [self.pad_token_id] * width)
                    self.forward_on_device(states, [1] * rows)
                    runs += 1
                    bar.update()
                    log.info("compiled shape class %d of 6 (%.0f s so far)", runs, time.perf_counter() - started)
                if rows == 1 and self.cache.slots == 1:
                    self.state(names[1])  # grows the cache to several slots
        except KVCacheFull:  # a budget too small for two short sequences: those shapes compile when first used
            pass
        finally:
            bar.close()
            for sequence in names:
                self.release(sequence)
        log.info("compiled %d shape classes in %.1f s", runs, time.perf_counter() - started)
        return runs

    @torch.inference_mode()
    def prefill(self, state: SequenceState, upto: int) -> None:
        """Cache the first `upto` tokens without keeping logits (prompt processing)."""
        self.prefill_many([state], [upto])

    @torch.inference_mode()
    def prefill_many(self, states: list[SequenceState], uptos: list[int]) -> None:
        """Cache each state's first `upto` tokens in as few forwards as pay (core.row_layout): rows join one forward
        (in slot order) while it costs about what their tokens do; the rest start another."""
        rows = sorted(((s, s.tokens[s.cached : u]) for s, u in zip(states, uptos, strict=True) if u > s.cached),
                      key=lambda row: row[0].slot)
        groups: list[list[tuple[SequenceState, list[int]]]] = []
        for row in rows:
            joined = [*groups[-1], row] if groups else [row]
            if groups and self.layout.one_forward_pays(joined):
                groups[-1:] = [joined]
            else:
                groups.append([row])
        for group in groups:
            self._forward([s for s, _ in group], [new for _, new in group], [0] * len(group))

    def fits_one_forward(self, states: list[SequenceState]) -> bool:
        """Whether feeding every state's pending tokens in one forward pays, prefill_many's rule: then a prompt can
        be fed in the forward that scores its last token, which saves a forward that reads every weight again."""
        rows = sorted(((s, s.pending) for s in states), key=lambda row: row[0].slot)
        return self.layout.one_forward_pays(rows)

    @torch.inference_mode()
    def forward(self, states: list[SequenceState], wants: list[int]) -> list[torch.Tensor]:
        """Feed every state's pending tokens; the logits [want_i, V] of each row's last want_i tokens, on the host in
        float32 (tests and calibration; the drafter and verifier keep them on the device, `forward_on_device`)."""
        logits = self.forward_on_device(states, wants)
        return list(logits.float().cpu().split(wants))

    @torch.inference_mode()
    def forward_on_device(self, states: list[SequenceState], wants: list[int], head: bool = True) -> torch.Tensor:
        """Feed every state's pending tokens; the logits [sum(wants), V] of each row's last want_i tokens, rows in
        order, on the model's device in its dtype; with `head` False their last hidden states [sum(wants), H], for
        `logits` to turn into logits a part at a time (a prompt's every position: core.prompt_logprobs)."""
        return self._forward(states, [state.pending for state in states], wants, head)

    @torch.inference_mode()
    def forward_fed(self, states: list[SequenceState], tokens: torch.Tensor) -> torch.Tensor:
        """Feed each state one token given on the device (tokens [rows], in states' order: the step before's choices,
        so the host queues this forward without waiting for them); the logits [rows, V] of those positions. Each
        state's `cached` moves on by one; its `tokens` are the caller's to complete once the choices reach it."""
        return self._forward(states, [[self.pad_token_id]] * len(states), [1] * len(states), fed=tokens)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits [N, V] of last hidden states [N, H] from forward_on_device(head=False)."""
        return self.head(hidden.unsqueeze(0))[0]

    def _forward(self, states: list[SequenceState], news: list[list[int]], wants: list[int],
                 head: bool = True, fed: torch.Tensor | None = None) -> torch.Tensor:
        """`fed`: one token per state on the device, in place of `news`' placeholders (forward_fed)."""
        self._fit(0, max(state.cached + len(new) for state, new in zip(states, news, strict=True)), shrink=True)
        by_slot = {state.slot: new for state, new in zip(states, news, strict=True)}
        lo, hi = min(by_slot), max(by_slot) + 1
        width = max(len(new) for new in news)
        on_slots = None if fed is None else ([state.slot for state in states], fed)
        with self._model_lock:
            hidden, first = self._run_model(by_slot, lo, hi, width, on_slots)
        for state, new in zip(states, news, strict=True):
            state.cached += len(new)
        if not any(wants):
            return torch.empty(0, self.vocab_size if head else hidden.shape[-1], device=self.device)
        # Logits only where asked: each row's last `want` real tokens, gathered into one dense batch.
        picks = [first[state.slot] + col for state, new, want in zip(states, news, wants, strict=True)
                 for col in range(len(new) - want, len(new))]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        hidden = hidden.index_select(0, on_device(picks, self.device)).unsqueeze(0)
        return self.head(hidden)[0] if head else hidden[0]

    def _run_model(self, fed: dict[int, list[int]], lo: int, hi: int, width: int,
                   on_slots: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
        """The model's last hidden states for `fed` (new tokens by slot): a static forward where one applies, else an
        eager one, padded or packed as the layout says; and where each slot's first new token lies in them.
        `on_slots`: (slots, tokens on the device) whose first new token is that device tensor's, not `fed`'s."""
        hidden = None
        if self.graphs is not None and self.mask_dtype == torch.bool:
            every_start = [s.cached if s is not None else 0 for s in self.occupants]
            hidden = self.graphs.run(hi, every_start, fed, width, self.pad_token_id, on_slots)
        if hidden is not None:
            first = {slot: slot * width for slot in fed}  # where each slot's first new token lies in `hidden`
        else:
            starts = [self.occupants[slot].cached for slot in range(lo, hi)]
            counts = [len(fed.get(slot, ())) for slot in range(lo, hi)]
            pack = self.layout.packs(len(fed), (hi - lo) * width, sum(counts))
            step = Step.build(lo, starts, counts, self.device, packed=pack)
            if pack:
                ids, positions, first = packed_inputs(fed, starts, lo)
                mask, segments = None, step.segments(self.device)
            else:
                ids, positions, first = padded_inputs(fed, starts, lo, width, self.pad_token_id)
                mask = step.mask(width, self.mask_dtype, self.device, self.causal_kernel)
                segments = None
            ids = on_device(ids, self.device)
            if on_slots is not None:
                slots, tokens = on_slots
                ids.view(-1).index_copy_(0, on_device([first[slot] for slot in slots], self.device), tokens)
            self.cache.step = step
            try:
                hidden = self._hidden(ids, on_device(positions, self.device), mask, segments)
            finally:
                self.cache.step = None
        return hidden, first

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                segments: list | None = None) -> torch.Tensor:
        """The model's last hidden state for a forward under the cache's current step; `segments`: the rows of a
        packed step (Step.segments), whose attention runs per row."""
        extra = {self.cache_keyword: self.cache} | ({SEGMENTS: segments} if segments is not None else {})
        with packed(self.model.config, varlen=segments is not None):
            return self.model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                                         **extra).last_hidden_state
