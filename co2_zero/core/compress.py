"""Block quantization of the exchange, with error feedback (docs/design.md §5): pure tensor functions,
no torch.distributed.

A vector is cut into blocks of `BLOCK` consecutive elements (the last one may be shorter); each block
has one fp32 scale, `absmax / qmax`, and its elements travel as `x / scale`:

- `int8`: one byte, round half to even, clamped to [-127, 127] (qmax 127; -128 is never used, so the
  range is symmetric);
- `fp8`: one byte, `torch.float8_e4m3fn` (qmax 448, its largest finite value), clamped to ±448 and
  rounded to nearest even by the cast;
- `int4`: four bits, round half to even, clamped to [-7, 7] (qmax 7), sent as the code `q + 8`;
- `int2`: two bits, round half to even, clamped to [-1, 1] (qmax 1: a block's largest element and
  those above half of it keep their sign, the rest is 0), sent as the code `q + 2`.

Zero is a level of every format, so zeros (the partition's padding) arrive as zeros.

`int4` and `int2` codes are packed little-endian, element i of a record in bits
`[bits·(i mod m), bits·(i mod m + 1))` of byte `i // m`, m = 8 / bits.

An all-zero block has scale 0 and sends zeros. Dequantized, an element is `value * scale` in fp32. A
block holding NaN or Inf gets a NaN or Inf scale, so its dequantized values are never finite: a
non-finite displacement is still seen as one after the exchange, never turned into finite garbage.

Rows are quantized independently (a row is one sub-shard: what one rank sends to one owner), and each
row travels as one byte record: its scales (4 bytes each), then its values, padded to a multiple of 4
bytes so that every record's scales can be read in place. 256 elements per block make the record
(256·bits/8 + 4) / 1024 of the fp32 bytes: 0.254 (8 bits), 0.129 (4), 0.066 (2).

Error feedback (`quantize_with_feedback_`): a rank adds the residual it could not send last time to
what it sends now, and keeps the new residual, so the sum of what arrives over the rounds differs from
the sum of what was meant by at most one round's quantization error.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

BLOCK = 256  # elements per scale


class WireFormat(NamedTuple):
    """How one element travels: its dtype (uint8 codes when packed below a byte), the largest magnitude
    it takes, its bits."""

    name: str
    dtype: torch.dtype
    qmax: float
    bits: int = 8
    code_offset: float = 0.0  # packed formats: what a level adds to become its code


FORMATS = {
    "int8": WireFormat("int8", torch.int8, 127.0),
    "fp8": WireFormat("fp8", torch.float8_e4m3fn, 448.0),
    "int4": WireFormat("int4", torch.uint8, 7.0, bits=4, code_offset=8.0),
    "int2": WireFormat("int2", torch.uint8, 1.0, bits=2, code_offset=2.0),
}


def value_bytes(length: int, bits: int) -> int:
    """Bytes of `length` values of `bits` bits, packed."""
    return math.ceil(length * bits / 8)


class RecordLayout(NamedTuple):
    """Bytes of one quantized row of `length` elements: `blocks` fp32 scales, then the values, padded."""

    length: int
    blocks: int
    nbytes: int
    bits: int = 8

    @classmethod
    def for_length(cls, length: int, block: int = BLOCK, bits: int = 8) -> RecordLayout:
        blocks = math.ceil(length / block)
        return cls(length, blocks, 4 * math.ceil((4 * blocks + value_bytes(length, bits)) / 4), bits)

    def split(self, records: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales) views of `records`, a uint8 tensor of shape (rows, nbytes); packed formats'
        values are their bytes."""
        scales = records.view(torch.float32)[:, : self.blocks]
        values = records[:, 4 * self.blocks : 4 * self.blocks + value_bytes(self.length, self.bits)]
        return (values if fmt.bits < 8 else values.view(fmt.dtype)), scales


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """out (rows, ceil(length·bits/8); uint8) <- the `bits`-bit codes (rows, length; uint8), packed."""
    per_byte = 8 // bits
    rows, length = codes.shape
    if length % per_byte:
        codes = torch.cat([codes, codes.new_zeros(rows, per_byte - length % per_byte)], dim=1)
    groups = codes.view(rows, -1, per_byte)
    out.copy_(groups[..., 0])
    for j in range(1, per_byte):
        out.bitwise_or_(groups[..., j] << (bits * j))


def unpack_codes(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """The codes (rows, length; uint8) that `pack_codes` packed into `packed`."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts).bitwise_and_(mask)
    return codes.flatten(-2)[:, :length] if per_byte * packed.shape[-1] != length else codes.flatten(-2)


def _blocks(rows: torch.Tensor, scales: torch.Tensor, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(elements, scale) view pairs of `rows` (rows, length) and its `scales` (rows, blocks) that
    broadcast against each other: the full blocks, then the shorter last block if there is one."""
    length = rows.shape[-1]
    full = length // block
    pairs = []
    if full:
        pairs.append((rows[:, : full * block].unflatten(-1, (full, block)), scales[:, :full, None]))
    if length % block:
        pairs.append((rows[:, full * block :].unsqueeze(1), scales[:, full:, None]))
    return pairs


def quantize_into(
    rows: torch.Tensor, fmt: WireFormat, records: torch.Tensor, scratch: torch.Tensor, block: int = BLOCK
) -> None:
    """Quantize each row of `rows` (rows, length; fp32) into `records` (rows, nbytes; uint8).

    `scratch` (fp32, the shape of `rows`, may not alias it) is overwritten; it saves a temporary the
    size of `rows`.
    """
    layout = RecordLayout.for_length(rows.shape[-1], block, fmt.bits)
    values, scales = layout.split(records, fmt)
    torch.abs(rows, out=scratch)
    for elements, scale in _blocks(scratch, scales, block):
        scale.copy_(elements.amax(dim=-1, keepdim=True))  # amax propagates NaN
    scales.div_(fmt.qmax)
    scratch.copy_(rows)
    for elements, scale in _blocks(scratch, scales, block):
        elements.div_(scale.masked_fill(scale == 0, 1.0))  # an all-zero block stays zero
    if fmt.dtype != torch.float8_e4m3fn:
        scratch.round_()
    scratch.clamp_(-fmt.qmax, fmt.qmax)
    if fmt.bits == 8:
        values.copy_(scratch)  # exact for int8; rounds to nearest even for fp8
        return
    # a non-finite block's scale already says so: its codes need only be some valid code
    codes = scratch.nan_to_num_(0.0, 0.0, 0.0).add_(fmt.code_offset)
    pack_codes(codes.to(torch.uint8), fmt.bits, values)


def dequantize_into(records: torch.Tensor, fmt: WireFormat, out: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """out (rows, length; fp32) <- the values of `records` times their block's scale. Returns `out`."""
    values, scales = RecordLayout.for_length(out.shape[-1], block, fmt.bits).split(records, fmt)
    if fmt.bits == 8:
        out.copy_(values)
    else:
        out.copy_(unpack_codes(values, fmt.bits, out.shape[-1])).sub_(fmt.code_offset)
    for elements, scale in _blocks(out, scales, block):
        elements.mul_(scale)
    return out


def quantize_with_feedback_(
    rows: torch.Tensor, residual: torch.Tensor, fmt: WireFormat, records: torch.Tensor, block: int = BLOCK
) -> None:
    """One error-feedback step, in place: rows <- rows + residual; records <- quantize(rows);
    residual <- rows - dequantize(records), what this send could not carry (the next one adds it).

    `rows` and `residual` are fp32 tensors of shape (rows, length); `records` is uint8 (rows, nbytes).
    """
    rows.add_(residual)
    quantize_into(rows, fmt, records, scratch=residual, block=block)
    dequantize_into(records, fmt, out=residual, block=block)
    torch.sub(rows, residual, out=residual)
