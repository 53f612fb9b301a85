"""The gateway's OpenAI-compatible HTTP API, served by uvicorn on the gateway's own event loop beside gRPC.

    tandem serve --http-port 8000   # the default; 0: a free port; -1: off
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x").chat.completions.create(
        model=<the served target>, messages=[...], extra_body={"speculation": "off", "top_k": 20})

schemas (request bodies) -> convert (a tandem.v1 GenerateRequest) -> tandem.gateway.generation (the generate path
gRPC uses too) -> responses and tokens (OpenAI's response, chunk and logprobs shapes); app has the routes, errors
the error shape, streaming the client-disconnect handling, server the uvicorn wiring.
"""
