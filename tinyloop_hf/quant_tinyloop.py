"""Low-bit weight formats (INT8 / INT4 / INT3 / INT2), their packing, QuantLinear and QuantEmbedding.

Layout of a QuantLinear with ``out_features = N`` rows and ``in_features = K`` columns (the checkpoint layout is
the kernel layout; nothing is repacked after loading). A QuantEmbedding stores its table the same way, with one row
per vocabulary entry and ``embedding_dim`` columns:

* ``w = (q - z) * s`` per group of ``g`` consecutive columns of a row. ``q`` is the unsigned code in
  ``[0, 2^b)``; ``z`` is an integer zero point (``zeros``, uint8 [N, K/g]) for asymmetric formats and the fixed
  midpoint ``2^(b-1)`` for symmetric ones; ``s`` is ``scales`` [N, K/g] in fp16 or bf16. In fp32 the product is
  exact, so dequantization has one rounding: the final cast to the activation dtype.
* ``qweight`` int32 [N, K*b/32] for b in {2, 4, 8}. Word ``w`` of row ``n`` holds the 32/b consecutive columns
  starting at ``w * 32/b``. The even-indexed of those columns fill bits 0-15 in ascending order and the odd-indexed
  ones bits 16-31, so masking one field per 16-bit half yields two *adjacent* columns as a half2 pair
  (INT4: nibbles [k0 k2 k4 k6 | k1 k3 k5 k7], the FasterTransformer/Marlin order; INT8: PRMT selectors
  0x5250/0x5351 give (k0, k1)/(k2, k3); INT2: masks 0x00030003 << 2i). A lane's 16-byte load is 4 words:
  32 INT4, 16 INT8 or 64 INT2 consecutive columns of one row; rows are contiguous, so a warp reads 512 bytes.
* INT3 is two bit-planes: ``qweight`` holds the low 2 bits in the INT2 layout ([N, K/16]) and ``qweight_high``
  int32 [N, K/32] the third bit in the same even/odd order (bit j of the low half is column 2j of the word's 32).
  Both planes keep the 16-byte load property.
* Requirements: K is a multiple of 32; group_size is 32, 64, 128 or None (one group per row, "per output
  channel"). Groups start every group_size columns; when group_size does not divide K (SmolLM2's 576 = 4.5 x 128)
  the last group is shorter, so ``scales``/``zeros`` have ceil(K / group_size) columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .configuration_tinyloop import is_int
from .ops_tinyloop import REFERENCE, get_op, register_op

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, None)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    group_size: int | None = 128  # None: one group per output row
    symmetric: bool = False
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        # Types first: 4.0 == 4 and "false" is truthy, so a membership test alone would let them through.
        if not is_int(self.bits) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"quantization bits must be one of {list(SUPPORTED_BITS)}, got {self.bits!r}")
        if not (self.group_size is None or is_int(self.group_size)) or self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"quantization group_size must be one of {list(SUPPORTED_GROUP_SIZES)} (None = per output channel), "
                f"got {self.group_size!r}"
            )
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"quantization symmetric must be true or false, got {self.symmetric!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"quantization scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {self.scale_dtype!r}"
            )

    @property
    def max_code(self) -> int:
        return 2**self.bits - 1

    @property
    def midpoint(self) -> int:
        return 2 ** (self.bits - 1)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else -(-in_features // self.group_size)

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def check_shape(self, columns: int, name: str = "layer", what: str = "in_features") -> None:
        """``columns``: the packed row's length (a linear's in_features, an embedding's embedding_dim)."""
        if columns % 32:
            raise ValueError(f"{name}: {what}={columns} must be a multiple of 32 to be packed")

    def tensor_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor a QuantLinear (or QuantEmbedding) of this format stores."""
        groups = self.groups(in_features)
        low_bits = 2 if self.bits == 3 else self.bits
        shapes = {
            "qweight": ((out_features, in_features * low_bits // 32), torch.int32),
            "scales": ((out_features, groups), SCALE_DTYPES[self.scale_dtype]),
        }
        if self.bits == 3:
            shapes["qweight_high"] = ((out_features, in_features // 32), torch.int32)
        if not self.symmetric:
            shapes["zeros"] = ((out_features, groups), torch.uint8)
        return shapes


# ----------------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------------


def _field_order(per_word: int, device: torch.device) -> torch.Tensor:
    """Column offsets in field order: even columns, then odd ones (each half of the word in ascending order).
    Made on ``device``: a host tensor copied over would synchronize, which a CUDA-graph capture forbids."""
    return torch.cat((torch.arange(0, per_word, 2, device=device), torch.arange(1, per_word, 2, device=device)))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint codes [N, K] (< 2^bits, bits in 1, 2, 4, 8) -> int32 words [N, K*bits/32] in the documented order."""
    per_word = 32 // bits
    rows, columns = codes.shape
    order = _field_order(per_word, codes.device)
    fields = codes.to(torch.int64).reshape(rows, columns // per_word, per_word)[..., order]
    shifts = torch.arange(per_word, dtype=torch.int64, device=codes.device) * bits
    words = (fields << shifts).sum(-1)  # < 2^32, exact in int64
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: int32 [N, W] -> int64 codes [N, W*32/bits]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=words.device) * bits
    fields = (words.to(torch.int64)[..., None] >> shifts) & (2**bits - 1)  # [N, W, per_word], field order
    codes = torch.empty_like(fields)
    codes[..., _field_order(per_word, words.device)] = fields
    return codes.flatten(-2)


@dataclass
class PackedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    qweight_high: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: value for name, value in vars(self).items() if value is not None}


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: QuantFormat) -> PackedWeight:
    """codes [N, K] in [0, 2^b), scales [N, G] (already in the scale dtype), zeros [N, G] ints or None."""
    if fmt.bits == 3:
        qweight, high = pack_codes(codes & 3, 2), pack_codes(codes >> 2, 1)
    else:
        qweight, high = pack_codes(codes, fmt.bits), None
    zeros = None if fmt.symmetric else zeros.to(torch.uint8)
    return PackedWeight(qweight, scales, zeros, high)


def unpack(packed: PackedWeight, fmt: QuantFormat) -> torch.Tensor:
    """int64 codes [N, K]."""
    if fmt.bits == 3:
        return unpack_codes(packed.qweight, 2) | (unpack_codes(packed.qweight_high, 1) << 2)
    return unpack_codes(packed.qweight, fmt.bits)


def _per_column(values: torch.Tensor, width: int, columns: int) -> torch.Tensor:
    """[N, G] group values -> [N, K] (the last group may be shorter than ``width``)."""
    return values.repeat_interleave(width, dim=1)[:, :columns]


def dequantize(packed: PackedWeight, fmt: QuantFormat) -> torch.Tensor:
    """w = (q - z) * s, exact in fp32: [N, K]."""
    codes = unpack(packed, fmt)
    width = fmt.group_width(codes.shape[1])
    zero = fmt.midpoint if fmt.symmetric else _per_column(packed.zeros.to(torch.int64), width, codes.shape[1])
    return (codes - zero).to(torch.float32) * _per_column(packed.scales.to(torch.float32), width, codes.shape[1])


# ----------------------------------------------------------------------------------------------------------------------
# Round-to-nearest grid (also used by GPTQ for its group parameters)
# ----------------------------------------------------------------------------------------------------------------------


def group_parameters(weight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (rounded up to the stored dtype, as fp32) and integer zero point per row of ``weight`` [N, g].

    Symmetric: s = 2 max|w| / (2^b - 1), z = 2^(b-1). Asymmetric: the range is widened to include 0, then
    s = (max - min) / (2^b - 1), z = round(-min / s). An all-zero group gets s = 1.
    """
    weight = weight.float()
    if fmt.symmetric:
        scale = 2 * weight.abs().amax(-1) / fmt.max_code
    else:
        low, high = weight.amin(-1).clamp(max=0), weight.amax(-1).clamp(min=0)
        scale = (high - low) / fmt.max_code
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # Rounded up to the stored dtype, so that the grid still spans the group's range: rounded to nearest, a bf16 scale
    # (8-bit mantissa) often came out smaller and clipped the group's extreme weights (INT8: up to 1.4 steps off).
    stored = scale.to(SCALE_DTYPES[fmt.scale_dtype])
    up = (stored.view(torch.int16) + 1).view(stored.dtype)  # the next value up (scales are positive and finite)
    scale = torch.where(stored.float() < scale, up, stored).to(torch.float32)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float16).tiny))  # underflow
    if fmt.symmetric:
        zero = torch.full_like(scale, fmt.midpoint)
    else:
        zero = torch.round(-low / scale).clamp(0, fmt.max_code)
    return scale, zero


def quantize_codes(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Nearest code for ``weight`` [N, g] with per-row ``scale``/``zero`` [N]."""
    return torch.clamp(torch.round(weight.float() / scale[:, None]) + zero[:, None], 0, fmt.max_code)


def split_groups(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[N, K] -> [N * groups, width] in fp32, a short last group zero-padded (which changes no group's parameters:
    every group's range already includes 0)."""
    rows, columns = weight.shape
    width, groups = fmt.group_width(columns), fmt.groups(columns)
    return torch.nn.functional.pad(weight.float(), (0, groups * width - columns)).reshape(rows * groups, width)


def quantize_rtn(weight: torch.Tensor, fmt: QuantFormat) -> PackedWeight:
    """Round-to-nearest quantization of ``weight`` [N, K]."""
    weight = weight.detach()  # packed tensors must not keep an autograd graph (and the weights it saved) alive
    rows, columns = weight.shape
    fmt.check_shape(columns)
    grouped = split_groups(weight, fmt)
    scale, zero = group_parameters(grouped, fmt)
    codes = quantize_codes(grouped, scale, zero, fmt).to(torch.int64).reshape(rows, -1)[:, :columns]
    scales = scale.reshape(rows, -1).to(SCALE_DTYPES[fmt.scale_dtype])
    return pack(codes, scales, zero.reshape(rows, -1).to(torch.int64), fmt)


# ----------------------------------------------------------------------------------------------------------------------
# Packed modules: QuantLinear, QuantEmbedding
# ----------------------------------------------------------------------------------------------------------------------


class PackedModule(nn.Module):
    """What QuantLinear and QuantEmbedding share: one packed matrix of ``packed_dims`` = (rows, columns) in
    ``format`` (buffers qweight / scales / zeros / qweight_high), loading and dequantizing it, and the dtype rule."""

    def __init__(self, rows: int, columns: int, fmt: QuantFormat, name: str, what: str) -> None:
        super().__init__()
        fmt.check_shape(columns, name, what)
        self.format, self.packed_dims = fmt, (rows, columns)
        for tensor_name, (shape, dtype) in fmt.tensor_shapes(rows, columns).items():
            self.register_buffer(tensor_name, torch.zeros(shape, dtype=dtype))

    def packed(self) -> PackedWeight:
        return PackedWeight(
            self.qweight, self.scales, getattr(self, "zeros", None), getattr(self, "qweight_high", None)
        )

    def load_packed(self, packed: PackedWeight) -> None:
        for name, value in packed.tensors().items():
            expected = getattr(self, name)
            if value.shape != expected.shape or value.dtype != expected.dtype:
                raise ValueError(
                    f"packed tensor {name}: expected {list(expected.shape)} {expected.dtype}, "
                    f"got {list(value.shape)} {value.dtype}"
                )
            setattr(self, name, value.to(expected.device))

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.packed(), self.format)

    def _apply(self, fn: Any, recurse: bool = True) -> PackedModule:
        # model.to(dtype) must not re-round the stored scales: keep their dtype, follow only the device move.
        scales = self.scales
        super()._apply(fn, recurse)
        if self.scales.dtype != scales.dtype:
            self.scales = scales.to(self.scales.device)
        return self

    def _format_repr(self) -> str:
        fmt = self.format
        kind = "sym" if fmt.symmetric else "asym"
        return f"bits={fmt.bits}, group_size={fmt.group_size}, {kind}, scales={fmt.scale_dtype}"


@register_op("quant_linear", REFERENCE)
def quant_linear(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """y = x dequantize(W)^T + b: exactly F.linear on the dequantized weight cast to x.dtype."""
    weight = dequantize(layer.packed(), layer.format).to(x.dtype)
    return torch.nn.functional.linear(x, weight, layer.bias)


class QuantLinear(PackedModule):
    """A linear layer with packed low-bit weights (see the module docstring for the layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: QuantFormat, name: str = "") -> None:
        super().__init__(out_features, in_features, fmt, name or "QuantLinear", "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.op_backend = REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("quant_linear", self.op_backend)(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._format_repr()}"


@register_op("quant_embedding", REFERENCE)
def quant_embedding(input_ids: torch.Tensor, table: QuantEmbedding) -> torch.Tensor:
    """The rows ``input_ids`` of a packed embedding table, dequantized exactly (fp32) and cast to its compute dtype.
    Row gathers and elementwise unpacking only: no host tensor and no sync, so a CUDA graph can capture it."""
    rows = input_ids.reshape(-1)
    packed = PackedWeight(**{name: value.index_select(0, rows) for name, value in table.packed().tensors().items()})
    values = dequantize(packed, table.format).to(table.compute_dtype)
    return values.reshape(*input_ids.shape, table.embedding_dim)


class QuantEmbedding(PackedModule):
    """A token embedding table with packed low-bit rows (one per vocabulary entry; layout as QuantLinear's).

    A lookup dequantizes only the rows asked for, exactly as ``dequantize`` does the whole table (fp32), then casts
    them to ``compute_dtype``. nn.Embedding's output takes its weight's dtype; a packed table has no float weight to
    carry the model's dtype, so ``compute_dtype`` does: it starts as the dtype of the table it replaces (float32 by
    default) and follows ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` the way a float parameter would.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        fmt: QuantFormat,
        name: str = "",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, fmt, name or "QuantEmbedding", "embedding_dim")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None  # nn.Embedding's attribute, read by generic code; no row is special here
        self.compute_dtype = dtype
        self.op_backend = REFERENCE

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return get_op("quant_embedding", self.op_backend)(input_ids, self)

    def _apply(self, fn: Any, recurse: bool = True) -> QuantEmbedding:
        super()._apply(fn, recurse)
        # What ``fn`` makes of an empty float tensor is what it would have made of a float weight.
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype, device=self.qweight.device)).dtype
        return self

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, {self._format_repr()}, "
            f"compute_dtype={self.compute_dtype}"
        )


def packed_shape_errors(model: nn.Module) -> list[str]:
    """Packed tensors whose shape or dtype differ from their module's format (transformers 5.17 loads a mis-shaped
    buffer silently instead of reporting it)."""
    errors = []
    for module_name, module in model.named_modules():
        if not isinstance(module, PackedModule):
            continue
        for name, (shape, dtype) in module.format.tensor_shapes(*module.packed_dims).items():
            actual = getattr(module, name)
            if tuple(actual.shape) != shape or actual.dtype != dtype:
                errors.append(
                    f"{module_name}.{name}: checkpoint {list(actual.shape)} {actual.dtype}, model {list(shape)} {dtype}"
                )
    return errors
