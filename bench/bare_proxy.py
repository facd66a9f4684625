"""python -m bench.bare_proxy PORT TARGET [CA CERT KEY]: the smallest grpc.aio proxy of relaygr.v1.Ranker/Rank
(bytes in, the same bytes to TARGET, its bytes back), with the router's gRPC I/O settings and
event loop (mutual TLS on both sides with the three PEM files). bench/router.py times it beside the router: the cost of a Python gRPC hop itself, so
that what the router adds can be read against it in the same run."""

from __future__ import annotations

import importlib
import json
import sys

# The router's entry module first: it sets the router's GRPC_EXPERIMENTS before gRPC is imported.
importlib.import_module("services.router.__main__")

import grpc  # noqa: E402
import uvloop  # noqa: E402

from shared.tls import TlsSettings  # noqa: E402


def _same(data: bytes) -> bytes:
    return data


async def serve(port: int, target: str, tls: TlsSettings) -> None:
    channel = tls.channel(target)
    forward = channel.unary_unary(
        "/relaygr.v1.Ranker/Rank", request_serializer=_same, response_deserializer=_same
    )

    async def rank(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        reply: bytes = await forward(request, timeout=context.time_remaining())
        return reply

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(rank, request_deserializer=_same, response_serializer=_same)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("relaygr.v1.Ranker", {"Rank": handler}),)
    )
    tls.add_port(server, f"127.0.0.1:{port}")
    await server.start()
    print(json.dumps({"event": "bare_proxy_ready", "port": port}), file=sys.stderr, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), sys.argv[2], TlsSettings(*sys.argv[3:6])))
