"""Python clients for a tandem gateway: TandemClient (blocking) and AsyncTandemClient (asyncio).

    with TandemClient("127.0.0.1:50051") as client:
        for item in client.generate("def fib(n):", temperature=0, max_tokens=64):
            ...  # pb.Chunk messages (item.index says which of the n choices), then one pb.Complete per choice
        result = client.generate_result(chat=[{"role": "user", "content": "hi"}], n=2)
        result.text, result.choices[1].text, result.finish_reason, result.usage, result.speculation
        client.tokenize("def fib(n):"), client.model_info(), client.abort("my-request-id")

    TandemClient("gateway.example:443", tls=True, root_certificates="ca.pem", api_key=os.environ["TANDEM_API_KEY"])

Only grpcio, grpcio-health-checking and protobuf are needed (`pip install tandem`, no torch). Failures surface as
grpc.RpcError (see .code() and .details()); client-side misuse (two inputs, an unknown speculation mode, a
certificate without tls=True) raises tandem.errors.InvalidArgument before anything is sent. Values the server checks
(temperature ranges, max_tokens limits) are left to the server, so every client gets the same INVALID_ARGUMENT.
"""

from tandem.client.async_client import AsyncTandemClient
from tandem.client.channel import ChannelSettings, PemSource
from tandem.client.requests import (
    READINESS_SERVICE,
    SPECULATION_MODES,
    ChatMessages,
    GenerateOptions,
    Speculation,
    build_request,
    build_tokenize_request,
)
from tandem.client.results import (
    FINISH_REASONS,
    Choice,
    Collector,
    FinishReason,
    GenerateResult,
    SpeculationStats,
    TokenLogprob,
    Usage,
)
from tandem.client.sync_client import TandemClient

__all__ = [
    "FINISH_REASONS",
    "READINESS_SERVICE",
    "SPECULATION_MODES",
    "AsyncTandemClient",
    "ChannelSettings",
    "ChatMessages",
    "Choice",
    "Collector",
    "FinishReason",
    "GenerateOptions",
    "GenerateResult",
    "PemSource",
    "Speculation",
    "SpeculationStats",
    "TandemClient",
    "TokenLogprob",
    "Usage",
    "build_request",
    "build_tokenize_request",
]
