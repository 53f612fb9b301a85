"""Request and engine configuration: slotted dataclasses validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.core.logprobs import MAX_TOP_LOGPROBS
from tandem.errors import InvalidArgument

GREEDY_BELOW = 1e-5  # a smaller temperature samples greedily (SamplingParams.greedy; vLLM's _SAMPLING_EPS)
MAX_DECODE_STEPS = 64  # tokens a plain row decodes in one verifier call (EngineConfig.decode_steps)


# The most token ids one request's logit_bias may name: a bound keeps what a request sends, and what each worker
# scatters into its logits every step, small next to a vocabulary.
MAX_LOGIT_BIAS = 1024


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(f"{field_name}: {message}")


def _shown(value: object) -> str:
    """A value as an error message shows it: a float to 7 significant digits, as a float32 holds it (a request's
    -0.1 reaches here as -0.10000000149011612 from the wire's float field)."""
    return f"{value:.7g}" if isinstance(value, float) else repr(value)


# What an output format may be (core.formats): a JSON schema ('{"type": "object"}' for any JSON object), a regular
# expression the whole output matches, or a grammar in llguidance's Lark dialect (the gateway's own, for the call a
# required or named tool_choice asks for: gateway.forced_calls).
# grammar: a client's, Lark or GBNF; lark: ours; structural_tag: tandem.response_format.structural_tags' JSON
OUTPUT_FORMAT_KINDS = ("json_schema", "regex", "grammar", "lark", "structural_tag")
MAX_OUTPUT_FORMAT_CHARS = 64 * 1024  # a schema or expression: compiled on every worker that serves the request


@dataclass(slots=True, frozen=True)
class OutputFormat:
    """A structure the output must follow (structured outputs, core.format_masks): every token of draft and target is
    sampled from the tokens that keep the output a prefix of a match, and the output ends (EOS) only where it is a
    whole match. `spec` is the JSON schema's text, the expression, or the grammar."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        _require(self.kind in OUTPUT_FORMAT_KINDS, "response_format",
                 f"kind must be one of {', '.join(OUTPUT_FORMAT_KINDS)}, got {self.kind!r}")
        _require(isinstance(self.spec, str) and 0 < len(self.spec) <= MAX_OUTPUT_FORMAT_CHARS, "response_format",
                 f"the {self.kind} must be non-empty text of at most {MAX_OUTPUT_FORMAT_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidArgument(f"response_format: the JSON schema does not parse: {exc}") from None
            _require(isinstance(schema, dict), "response_format", "a JSON schema is a JSON object")

    @classmethod
    def json_object(cls) -> OutputFormat:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_schema", '{"type": "object"}')


# Seconds a target forward may take per token it computes, beyond a fixed allowance: a verify call's deadline
# (workers.target_pool, until the pool shows a faster pace) and the gateway's stall watchdog (gateway.loop). The
# slowest forward measured: the 1.5B target in bf16 on one AVX2 core without bf16 FMA, 0.34 s a token of prefill.
TARGET_TOKEN_ALLOWANCE_S = 0.5
DEFAULT_MAX_TOKENS = 128  # a request's output length where it sets none: `tandem generate`, the gateway's default


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How tokens are chosen; applied identically to draft and target so verification stays lossless.

    temperature 0 means greedy, as does any below GREEDY_BELOW (as in vLLM: dividing the logits by it overflows float32,
    and the choice is the argmax anyway). top_k 0, top_p 1 and min_p 0 disable those filters.
    seed: the client's. A seeded request is reproducible: drafter-invariant sampling (Gumbel-max, core.sampling)
    gives exactly the tokens plain decoding gives with that seed, whether speculation is on or off, whatever k.
    engine_seed: chosen by the engine for a sampled request without a seed and sent to every worker and rank, so
    they all draw the same random numbers (keyed by position); such a request keeps the min(1, p/q) acceptance rule.
    repetition_penalty, presence_penalty, frequency_penalty, logit_bias: reshape the logits before temperature, top-k
    and top-p, on draft and target alike (core.penalties); neutral at 1, 0, 0 and none.
    output_format: a structure the output must follow (core.format_masks), masking draft and target logits alike after
    the penalties; None leaves the output free.
    min_tokens (vLLM's): the output's first min_tokens tokens are none of `end_ids`, the ids that would end it (its
    EOS unless ignored, its stop_token_ids; set by the engine), which draft and target alike hold back there
    (core.penalties): both sample from the same reshaped distribution, so speculation stays lossless.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # after temperature: drop tokens less likely than min_p times the most likely one
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    engine_seed: int | None = None
    logprobs: int | None = None  # report the target's logprob of each emitted token and this many alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (scored in the prefill)
    repetition_penalty: float = 1.0  # a token already in the context: positive logits divided by it, negative times
    presence_penalty: float = 0.0  # subtracted from the logit of each token the output holds at least once
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    output_format: OutputFormat | None = None
    min_tokens: int = 0
    end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.temperature, int | float) and 0.0 <= self.temperature <= 100.0,
                 "temperature", f"must be between 0 and 100, got {_shown(self.temperature)}")
        _require(isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0,
                 "top_p", f"must be in (0, 1], got {_shown(self.top_p)}")
        _require(isinstance(self.min_p, int | float) and 0.0 <= self.min_p <= 1.0,
                 "min_p", f"must be in [0, 1], got {_shown(self.min_p)}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0,
                 "top_k", f"must be a non-negative integer (0 disables), got {self.top_k!r}")
        _require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                 "seed", f"must be a non-negative integer below 2**63, got {self.seed!r}")
        _require(self.engine_seed is None or (isinstance(self.engine_seed, int) and 0 <= self.engine_seed < 2**63),
                 "engine_seed", f"must be a non-negative integer below 2**63, got {self.engine_seed!r}")
        _require(isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= 1_000_000,
                 "max_tokens", f"must be between 1 and 1000000, got {self.max_tokens!r}")
        _require(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                 "min_tokens", f"must be between 0 and the output's limit of {self.max_tokens} tokens, got "
                 f"{self.min_tokens!r}")
        _require(all(isinstance(t, int) and t >= 0 for t in self.end_ids), "end_ids",
                 "must be non-negative token ids")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                 "logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        _require(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                  and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
                 "prompt_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 "stop", "stop strings must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", "stop token ids must be non-negative integers")
        _require(isinstance(self.repetition_penalty, int | float) and 0.0 < self.repetition_penalty <= 10.0,
                 "repetition_penalty", f"must be in (0, 10], got {_shown(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(isinstance(value, int | float) and -2.0 <= value <= 2.0,
                     name, f"must be between -2 and 2, got {_shown(value)}")
        _require(len(self.logit_bias) <= MAX_LOGIT_BIAS,
                 "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            _require(isinstance(token, int) and token >= 0, "logit_bias", f"token ids must be non-negative integers, "
                     f"got {token!r}")
            _require(isinstance(bias, int | float) and -100.0 <= bias <= 100.0,
                     "logit_bias", f"biases must be between -100 and 100, got {_shown(bias)} for token {token}")
        _require(len({token for token, _ in self.logit_bias}) == len(self.logit_bias),
                 "logit_bias", "each token id at most once")
        _require(self.output_format is None or isinstance(self.output_format, OutputFormat),
                 "response_format", f"must be an OutputFormat, got {self.output_format!r}")
        # A format ends the output where a match is whole: past its EOS the structure allows nothing more.
        _require(self.output_format is None or not self.ignore_eos,
                 "ignore_eos", "cannot combine with a response format, which ends the output at a whole match")
        # A whole match may leave nothing but the end to choose: held back, no token would be left.
        _require(self.output_format is None or not self.min_tokens, "min_tokens",
                 "cannot combine with a response format or a required tool call, which end the output at a whole "
                 "match")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def reproducible(self) -> bool:
        """Sampled with a client's seed: drafter-invariant sampling applies."""
        return self.seed is not None and not self.greedy

    @property
    def reshapes_logits(self) -> bool:
        """Whether penalties or a logit bias apply (core.penalties): the logits depend on the context, not only on
        the model."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.holds_back_ends)

    @property
    def holds_back_ends(self) -> bool:
        """Whether min_tokens holds back some end ids."""
        return self.min_tokens > 0 and bool(self.end_ids)

    @property
    def key_seed(self) -> int | None:
        """The seed random numbers are keyed by: the client's, else the one the engine chose."""
        return self.seed if self.seed is not None else self.engine_seed


@dataclass(slots=True, frozen=True)
class SpecConfig:
    """Speculation knobs. The adaptive policy picks k in [0, k_max] each round; k_max 0 disables drafting.

    draft_confidence: with the adaptive policy, the drafter stops early once its top probability falls below this
    (0 never stops early; in a batch, an unsure row goes on as far as its mates that are still sure:
    core.local_drafter); a fixed k (adaptive off) always drafts k tokens. One session on the real pair with the
    w8a8 draft, both compiled (docs/bench/stop-rules-v1.json): 0.6 ran 1.024x the speed of 0.8 with the p99 ITL 4%
    longer; a draft step costs a fifth of a verification there, so an unsure draft is cheap to try.
    draft_vocab: the drafter scores only the first N token ids (BPE ids run roughly by frequency); verification
    still uses the target's full vocabulary, so output stays exact. 0 scores the whole vocabulary, the default: text
    whose tokens lie above N is drafted worse (Chinese in Qwen's vocabulary at 65536: AUTO 0.76x).
    plain_first_round: with the adaptive policy, a sequence's first round only prefills the target, so the first
    token comes as soon as in plain decoding; the drafter catches up on the prompt in the second round.
    acceptance_prior: a new deployment's per-token acceptance, before its sessions have measured one (the shared
    prior then follows what they measure). The real pair measures 0.77 (sampled, k 2) to 0.90 (greedy, k 4), and a
    served deployment's prior settled at 0.88; at a lower prior a new session on costs like the real pair's decides
    for plain decoding before its first draft.
    prompt_lookup: a row whose output's last tokens occur earlier in its context may draft the tokens that followed
    them there, for free, where that beats its draft model's drafts (core.prompt_lookup, core.round_plan rule 0);
    works without a draft model too.
    batch_catch_up_limit: with the adaptive policy, in a round of several sequences a sequence whose drafter is more
    than this many tokens behind (its prompt, tokens decoded plainly) does not draft yet: its drafter catches up on
    this many tokens a round (one draft forward for every such row), so no round stalls on a whole prompt. Shorter
    catch-ups are priced by core.batch_plan, which lets a row draft only where that pays.
    """

    enabled: bool = True
    k_max: int = 8
    k_init: int = 4
    adaptive: bool = True
    draft_top_m: int = 64
    draft_confidence: float = 0.6
    draft_vocab: int = 0
    acceptance_prior: float = 0.75
    prior_weight: float = 1.0
    ema_decay: float = 0.95
    enter_fallback_margin: float = 0.02
    exit_fallback_margin: float = 0.05
    probe_interval: int = 16
    probe_interval_max: int = 128
    plain_first_round: bool = True
    batch_catch_up_limit: int = 32
    prompt_lookup: bool = False

    def __post_init__(self) -> None:
        _require(0 <= self.k_max <= 32, "k_max", f"must be between 0 and 32, got {self.k_max}")
        _require(0 <= self.k_init <= self.k_max or self.k_max == 0, "k_init", "must be between 0 and k_max")
        _require(self.batch_catch_up_limit >= 1, "batch_catch_up_limit", "must be positive")
        _require(1 <= self.draft_top_m <= 4096, "draft_top_m", "must be between 1 and 4096")
        _require(0.0 <= self.draft_confidence < 1.0, "draft_confidence", "must be in [0, 1)")
        _require(self.draft_vocab >= 0, "draft_vocab", "must be non-negative (0 keeps the full vocabulary)")
        _require(0.0 < self.acceptance_prior < 1.0, "acceptance_prior", "must be in (0, 1)")
        _require(self.prior_weight > 0, "prior_weight", "must be positive")
        _require(0.0 < self.ema_decay <= 1.0, "ema_decay", "must be in (0, 1]")
        _require(0.0 <= self.enter_fallback_margin < 1.0, "enter_fallback_margin", "must be in [0, 1)")
        _require(self.exit_fallback_margin >= 0.0, "exit_fallback_margin", "must be non-negative")
        _require(1 <= self.probe_interval <= self.probe_interval_max, "probe_interval",
                 "must be between 1 and probe_interval_max")

    @property
    def speculating(self) -> bool:
        return self.enabled and self.k_max > 0

    @property
    def stop_confidence(self) -> float:
        """The confidence the drafter stops below (0: drafts every token it is asked for)."""
        return self.draft_confidence if self.adaptive else 0.0


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """prefill_chunk: while other sequences wait on a step for their next token (decoding, or new prompts prefilled
    whole), a longer prompt is prefilled at most this many tokens per step (chunked prefill), so it delays their next
    tokens by one chunk at a time rather than by its whole prefill at once; 0 prefills a prompt in one step.
    max_prefill_tokens: with none waiting, a prompt longer than this is still prefilled this many tokens a step, so
    the engine's steps end at least that often: a request arriving meanwhile joins within one such chunk (before, a
    5390-token prompt held a 3-token request 70-99 s on a 2-core CPU) and an abort lands there; 0: no cap.
    decode_steps: a step in which no row drafts decodes up to this many tokens a row in one call to the verifier,
    each forward fed the one before's choices on the device, so the host neither waits for the model between them
    nor makes a round trip to a worker per token (multi-step decoding). Tokens stream in blocks of that many, and a
    row that stops mid-block wastes the rest; 1 decodes a token per step."""

    spec: SpecConfig = field(default_factory=SpecConfig)
    max_batch: int = 16
    calibrate: bool = True
    prefill_chunk: int = 64
    max_prefill_tokens: int = 512
    decode_steps: int = 1

    def __post_init__(self) -> None:
        _require(1 <= self.max_batch <= 1024, "max_batch", "must be between 1 and 1024")
        _require(self.prefill_chunk >= 0, "prefill_chunk", "must be non-negative (0 prefills a prompt at once)")
        _require(self.max_prefill_tokens >= 0, "max_prefill_tokens", "must be non-negative (0: no cap)")
        _require(1 <= self.decode_steps <= MAX_DECODE_STEPS, "decode_steps",
                 f"must be between 1 and {MAX_DECODE_STEPS}")

    def calibrates(self, drafter: bool = True) -> bool:
        """Whether an engine times its forwards before serving: costs steer only an adaptive k (the policy, the
        batch plan); a fixed k drafts as given, so it starts at once. Without a drafter (`drafter` False), only its
        target's forwards and only where it looks up drafts for batches (core.batch_plan.free_blocks_that_pay prices
        them; one stream learns its widths as it serves, every round timed)."""
        wanted = self.spec.speculating if drafter else self.spec.prompt_lookup and self.max_batch > 1
        return self.calibrate and self.spec.adaptive and wanted
