"""The front door's HPACK decoder: the same headers as the reference decoder (python-hyper's
hpack) over a connection's worth of blocks sharing one dynamic table; a list over the limit is
refused while the table stays in step (the reference decoder loses it); malformed blocks are
errors; a block's cost does not grow with the entries it names."""

from __future__ import annotations

import random

import hpack
import pytest

from services.router.frontdoor.h2headers import ENTRY_OVERHEAD, HeaderBlockError, HeaderDecoder


def header_sets(seed: int, n: int) -> list[list[tuple[bytes, bytes]]]:
    """What gRPC clients send: repeated pseudo-headers, changing timeouts, some metadata, now and
    then a value long enough to evict the table."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/relaygr.v1.Ranker/Rank"),
                   (b":authority", b"127.0.0.1:5000"), (b"content-type", b"application/grpc"),
                   (b"te", b"trailers"), (b"grpc-timeout", b"%dm" % rng.randrange(1, 10_000))]  # fmt: skip
        for k in range(rng.randrange(4)):
            value = bytes(rng.randrange(32, 127) for _ in range(rng.choice((1, 20, 300, 5000))))
            headers.append((b"x-meta-%d" % k, value))
        if i % 7 == 3:
            headers.append((b"x-bin", bytes(rng.randrange(32, 127) for _ in range(200))))
        out.append(headers)
    return out


def test_decodes_what_the_reference_decodes_over_one_connection():
    encoder, reference, ours = hpack.Encoder(), hpack.Decoder(), HeaderDecoder(1 << 20)
    for headers in header_sets(1, 300):
        block = encoder.encode(headers)
        decoded = ours.decode(block)
        assert decoded.headers == [tuple(h) for h in reference.decode(block, raw=True)] == headers
        assert decoded.size == sum(ENTRY_OVERHEAD + len(n) + len(v) for n, v in headers)


def test_a_list_over_the_limit_is_refused_and_the_table_stays_in_step():
    encoder = hpack.Encoder()
    # The oversized block adds "x-after" to the dynamic table after the field that crosses the
    # limit; the next block names it by index only.
    oversized = encoder.encode([(b"x-big", b"v" * 100_000), (b"x-after", b"kept")])
    following = encoder.encode([(b":method", b"POST"), (b"x-after", b"kept")])
    assert len(following) == 2  # two indexed fields: it only decodes with the table in step

    ours = HeaderDecoder(65_536)
    refused = ours.decode(oversized)
    assert refused.headers is None
    assert refused.size > 100_000
    assert ours.decode(following).headers == [(b":method", b"POST"), (b"x-after", b"kept")]

    reference = hpack.Decoder()  # what the front door used before: it stops mid-block
    with pytest.raises(hpack.OversizedHeaderListError):
        reference.decode(oversized, raw=True)
    with pytest.raises(hpack.InvalidTableIndex):
        reference.decode(following, raw=True)


def test_the_limit_is_inclusive():
    headers = [(b"x-a", b"b" * 100)]
    size = ENTRY_OVERHEAD + 3 + 100
    block = hpack.Encoder().encode(headers)
    assert HeaderDecoder(size).decode(block).headers == headers
    assert HeaderDecoder(size - 1).decode(block).headers is None


@pytest.mark.parametrize(
    "block",
    [
        b"\x80",  # indexed field 0
        b"\xbf\x7f",  # indexed field beyond both tables
        b"\x00\x05ab",  # a name that runs past the end
        b"\x00\x01a\x85abc",  # a value that runs past the end
        b"\x00\x01a\x81\xff",  # Huffman padding that is not all ones (EOS inside)
        b"\x82\x20",  # a table size update after a field
        b"\x3f\xe2\x1f",  # a table size update to 4097 (above what was allowed)
        b"\x7f\xff\xff\xff\xff\xff\x01",  # an integer longer than any limit
    ],
    ids=["index-0", "index-unknown", "name-truncated", "value-truncated", "bad-huffman",
         "late-size-update", "size-update-too-large", "integer-overflow"],
)  # fmt: skip
def test_malformed_blocks_are_errors(block):
    with pytest.raises(HeaderBlockError):
        HeaderDecoder(65_536).decode(block)


def test_table_size_updates_are_honoured():
    decoder = HeaderDecoder(65_536, max_table_size=0)
    with pytest.raises(HeaderBlockError, match="above"):
        decoder.decode(b"\x3f\xe1\x1f")  # 4096: a peer told "0" may not grow its table
    assert decoder.decode(b"\x20\x82").headers == [(b":method", b"GET")]
    # An entry added while the table is 0 bytes is not kept: naming it is an error.
    decoder.decode(b"\x40\x01a\x01b")
    with pytest.raises(HeaderBlockError):
        decoder.decode(b"\xbe")


def test_a_block_past_the_limit_keeps_nothing_of_what_it_names():
    """One 4 KB table entry named 60,000 times: 240 MB as a list, refused without building it."""
    encoder = hpack.Encoder()
    decoder = HeaderDecoder(65_536)
    decoder.decode(encoder.encode([(b"x-big", b"v" * 4000)]))
    bomb = bytes((0x80 | 62,)) * 60_000  # indexed field 62: the newest dynamic entry
    decoded = decoder.decode(bomb)
    assert decoded.headers is None
    assert decoded.size == 60_000 * (ENTRY_OVERHEAD + 5 + 4000)
