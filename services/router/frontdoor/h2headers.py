"""HPACK decoding for the router's front door (RFC 7541) that fails a stream, not its connection,
when a header list is too large.

Why not `hpack.Decoder` alone: it raises OversizedHeaderListError part-way through a block, when
the entries after that point have not updated the dynamic table, so the connection's HPACK state
is lost and the connection must close: one call with a 100 KB header then kills every call on its
connection. `HeaderDecoder` always decodes the whole block, so the dynamic table stays in step
with the peer's encoder, and reports a list over the limit as `headers=None` for the caller to
refuse that one stream. Only a malformed block (`HeaderBlockError`: bad index, truncated string,
bad Huffman code, misplaced or too large table size update) is a connection error
(COMPRESSION_ERROR, RFC 9113 4.3).

Bounds: work is linear in the block's bytes (a block's size is capped by the frame layer). An
indexed field costs O(1) whatever the size of the entry it names (the entry is shared, never
copied), and once a list is over the limit nothing more is kept: entries without indexing are
skipped undecoded; only entries that enter the dynamic table are still decoded (at most the
table's size is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpack import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

__all__ = ["DEFAULT_TABLE_SIZE", "DecodedBlock", "HeaderBlockError", "HeaderDecoder", "Headers"]

Headers = list[tuple[bytes, bytes]]
DEFAULT_TABLE_SIZE = HeaderTable.DEFAULT_SIZE  # 4096: what a peer may use until told otherwise
ENTRY_OVERHEAD = 32  # RFC 7541 4.1 / RFC 9113 6.5.2: a field's size is name + value + 32


class HeaderBlockError(ValueError):
    """The block is not valid HPACK: the connection's decoding state is lost (COMPRESSION_ERROR)."""


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    """`headers` in order, or None when the list is over the limit; `size` is the list's size as
    RFC 9113 counts it (exact up to the limit; past it, a lower bound: skipped values count their
    encoded length)."""

    headers: Headers | None
    size: int


class HeaderDecoder:
    """One connection's HPACK decoder (its dynamic table lives as long as the connection).

    `max_list_bytes`: the largest header list returned; `max_table_size`: the dynamic table size
    this side allows (the SETTINGS_HEADER_TABLE_SIZE it announced, 4096 when it announced none).
    """

    def __init__(self, max_list_bytes: int, max_table_size: int = DEFAULT_TABLE_SIZE) -> None:
        if max_list_bytes < 0 or max_table_size < 0:
            raise ValueError("limits must be >= 0")
        self.max_list_bytes = max_list_bytes
        self.max_table_size = max_table_size
        self._table = HeaderTable()
        self._table.maxsize = min(DEFAULT_TABLE_SIZE, max_table_size)

    def decode(self, block: bytes) -> DecodedBlock:
        """Decodes a complete header block; raises HeaderBlockError when it is malformed (the
        table is then unusable: close the connection)."""
        try:
            return self._decode(block)
        except HPACKDecodingError as exc:  # a bad index (from HeaderTable) or Huffman code
            raise HeaderBlockError(str(exc)) from None
        except IndexError:  # an integer or string runs past the end
            raise HeaderBlockError("truncated header block") from None

    def _decode(self, block: bytes) -> DecodedBlock:
        table = self._table
        limit = self.max_list_bytes
        headers: Headers | None = []
        size = 0
        pos = 0
        end = len(block)
        fields = 0
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field (the entry is shared, not copied)
                if first != 0xFF:  # the usual one-byte index, inline: the hot path
                    index = first & 0x7F
                    pos += 1
                else:
                    index, pos = _integer(block, pos, 7)
                name, value = table.get_by_index(index)
                value_size = len(value)
            elif first & 0xE0 == 0x20:  # dynamic table size update: only before the first field
                if fields:
                    raise HeaderBlockError("table size update after a header field")
                new_size, pos = _integer(block, pos, 5)
                if new_size > self.max_table_size:
                    raise HeaderBlockError(f"table size {new_size} above the {self.max_table_size} allowed")
                table.maxsize = new_size
                continue
            else:  # a literal: with incremental indexing (01), without (0000) or never indexed (0001)
                indexing = bool(first & 0x40)
                index, pos = _integer(block, pos, 6 if indexing else 4)
                keep = indexing or headers is not None  # past the limit, only table entries matter
                if index:
                    name = table.get_by_index(index)[0]
                else:
                    name, pos = _string(block, pos, keep)
                start = pos
                value, pos = _string(block, pos, keep)
                value_size = len(value) if keep else pos - start
                if indexing:
                    table.add(name, value)
            fields += 1
            size += ENTRY_OVERHEAD + len(name) + value_size
            if headers is not None:
                if size > limit:
                    headers = None  # dropped: the list is refused, only its size is reported
                else:
                    headers.append((name, value))
        return DecodedBlock(headers, size)


def _integer(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer at `pos` (RFC 7541 5.1): (value, position after it). At most 4 extension
    bytes (values up to 2^28): nothing this decoder accepts is larger."""
    mask = (1 << prefix_bits) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 21:
            raise HeaderBlockError("HPACK integer too long")


def _string(data: bytes, pos: int, decode: bool) -> tuple[bytes, int]:
    """An HPACK string literal at `pos` (RFC 7541 5.2): (its bytes, Huffman-decoded, or b"" when
    `decode` is false, position after it)."""
    huffman = data[pos] & 0x80
    length, pos = _integer(data, pos, 7)
    stop = pos + length
    if stop > len(data):
        raise HeaderBlockError("header string runs past the end of the block")
    if not decode:
        return b"", stop
    raw = data[pos:stop]
    return (decode_huffman(raw) if huffman else raw), stop
