"""Mutual TLS on the gRPC hops, with certificates this test generates: a client with a
certificate of the deployment's CA is served through the router (either front door: the HTTP/2
relay or the gRPC server); plaintext and foreign certificates are turned away."""

from __future__ import annotations

import grpc
import pytest

from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.config import load_config
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.tls import TlsSettings
from tests.certs import issue, make_ca
from tests.rankers import rank_request, users

pytestmark = pytest.mark.integration


def tls_flags(t: TlsSettings) -> list[str]:
    return ["--tls-ca", t.tls_ca, "--tls-cert", t.tls_cert, "--tls-key", t.tls_key]


@pytest.mark.parametrize("front_door", ["relay", "grpc"])
async def test_mutual_tls_router_and_ranker(tmp_path, front_door):
    ca = make_ca("relaygr-test-ca")
    ranker_tls, router_tls, client_tls = (issue(ca, n, tmp_path / n) for n in ("ranker", "router", "client"))
    stranger = issue(make_ca("someone-else"), "stranger", tmp_path / "stranger")
    ranker = RankerService(load_config(RankerConfig, ["--device", "cpu", *tls_flags(ranker_tls)]))
    await ranker.start()
    router = RouterService(load_config(RouterConfig, ["--rankers", f"127.0.0.1:{ranker.port}", "--front-door",
                                                      front_door, "--consume-signals", "false", *tls_flags(router_tls)]))  # fmt: skip
    await router.start()
    prefixes, suffixes = users(21, 1, prefix_len=50)
    request = rank_request(prefixes[0], suffixes[0], "tls")
    target = f"127.0.0.1:{router.port}"
    try:
        assert [i.id for i in router.membership.healthy()] == [
            f"127.0.0.1:{ranker.port}"
        ]  # router -> ranker over mTLS
        async with client_tls.channel(target) as channel:
            reply = await pb_grpc.RankerStub(channel).Rank(request, timeout=30)
            assert reply.served_by == pb.FULL_RECOMPUTE
            assert len(reply.scores) == suffixes[0].candidates.numel()
        for untrusted in (grpc.aio.insecure_channel(target), stranger.channel(target)):
            async with untrusted as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.RankerStub(channel).Rank(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await router.shutdown(grace_s=0.5)
        await ranker.shutdown(grace_s=0.5)


def test_partial_tls_settings_are_refused_at_start():
    from shared.config import ConfigError

    with pytest.raises(ConfigError, match="needs all of"):
        load_config(RankerConfig, ["--device", "cpu", "--tls-ca", "/etc/hostname"])
