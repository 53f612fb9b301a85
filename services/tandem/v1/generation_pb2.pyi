# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "prompt", "token_ids", "chat", "sampling", "stop", "stop_token_ids", "speculation", "ignore_eos", "n", "logprobs", "prompt_logprobs", "priority", "prediction")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    prompt: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: SpeculationOptions
    ignore_eos: bool
    n: int
    logprobs: int
    prompt_logprobs: int
    priority: int
    prediction: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., prediction: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "response_format", "min_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    response_format: ResponseFormat
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "grammar", "structural_tag")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    grammar: str
    structural_tag: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("mode", "max_k")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[SpeculationOptions.Mode]
        MODE_AUTO: _ClassVar[SpeculationOptions.Mode]
        MODE_OFF: _ClassVar[SpeculationOptions.Mode]
    MODE_UNSPECIFIED: SpeculationOptions.Mode
    MODE_AUTO: SpeculationOptions.Mode
    MODE_OFF: SpeculationOptions.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationOptions.Mode
    max_k: int
    def __init__(self, mode: _Optional[_Union[SpeculationOptions.Mode, str]] = ..., max_k: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    complete: Complete
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools", "tool_choice", "single_tool_call")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    SINGLE_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    single_tool_call: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., single_tool_call: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "index", "tool_calls", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "fallback_rounds", "acceptance_per_position", "draft_failures", "predicted_rounds", "lookup_rounds", "accepted_lookup_tokens", "rejected_lookup_tokens")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    fallback_rounds: int
    acceptance_per_position: _containers.RepeatedScalarFieldContainer[float]
    draft_failures: int
    predicted_rounds: int
    lookup_rounds: int
    accepted_lookup_tokens: int
    rejected_lookup_tokens: int
    def __init__(self, rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., fallback_rounds: _Optional[int] = ..., acceptance_per_position: _Optional[_Iterable[float]] = ..., draft_failures: _Optional[int] = ..., predicted_rounds: _Optional[int] = ..., lookup_rounds: _Optional[int] = ..., accepted_lookup_tokens: _Optional[int] = ..., rejected_lookup_tokens: _Optional[int] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("finish_reason", "usage", "speculation", "request_id", "index")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    speculation: SpeculationStats
    request_id: str
    index: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("target_model", "draft_model", "vocab_size", "max_k", "draft_workers", "target_replicas", "tensor_parallel_size", "costs", "target_kv", "draft_kv", "context_length", "tokenizer")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_KV_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    vocab_size: int
    max_k: int
    draft_workers: int
    target_replicas: int
    tensor_parallel_size: int
    costs: CostModel
    target_kv: KVUsage
    draft_kv: KVUsage
    context_length: int
    tokenizer: TokenizerInfo
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_k: _Optional[int] = ..., draft_workers: _Optional[int] = ..., target_replicas: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., costs: _Optional[_Union[CostModel, _Mapping]] = ..., target_kv: _Optional[_Union[KVUsage, _Mapping]] = ..., draft_kv: _Optional[_Union[KVUsage, _Mapping]] = ..., context_length: _Optional[int] = ..., tokenizer: _Optional[_Union[TokenizerInfo, _Mapping]] = ...) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("eos_token_ids", "chat_template", "max_prompt_tokens")
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: bool
    max_prompt_tokens: int
    def __init__(self, eos_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[bool] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "chat")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: Chat
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVUsage(_message.Message):
    __slots__ = ("used_tokens", "reserved_tokens", "capacity_tokens")
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    used_tokens: int
    reserved_tokens: int
    capacity_tokens: int
    def __init__(self, used_tokens: _Optional[int] = ..., reserved_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("draft_step_seconds", "draft_rows_seconds", "forward_seconds", "batched", "acceptance_prior", "draft_forward_seconds")
    class DraftRowsSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class ForwardSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class DraftForwardSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DRAFT_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROWS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PRIOR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    draft_step_seconds: float
    draft_rows_seconds: _containers.ScalarMap[int, float]
    forward_seconds: _containers.ScalarMap[int, float]
    batched: _containers.RepeatedCompositeFieldContainer[BatchedForward]
    acceptance_prior: float
    draft_forward_seconds: _containers.ScalarMap[int, float]
    def __init__(self, draft_step_seconds: _Optional[float] = ..., draft_rows_seconds: _Optional[_Mapping[int, float]] = ..., forward_seconds: _Optional[_Mapping[int, float]] = ..., batched: _Optional[_Iterable[_Union[BatchedForward, _Mapping]]] = ..., acceptance_prior: _Optional[float] = ..., draft_forward_seconds: _Optional[_Mapping[int, float]] = ...) -> None: ...

class BatchedForward(_message.Message):
    __slots__ = ("rows", "width", "seconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    width: int
    seconds: float
    def __init__(self, rows: _Optional[int] = ..., width: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
