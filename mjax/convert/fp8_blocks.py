"""FP8 checkpoints with block scales (DeepSeek-V3 as published): each quantized linear weight W [O, I] is stored as
float8_e4m3fn beside `weight_scale_inv` [ceil(O / bo), ceil(I / bi)] fp32, one scale per bo x bi block
(config.json quantization_config.weight_block_size, [128, 128] in DeepSeek-V3), and W = fp8 * scale block by block
(DeepSeek's weight_dequant). Import reads the FP8 bytes and dequantises to bf16, one tensor at a time; the scales are
consumed, never mapped. Export writes bf16 (no quantization_config): keeping the FP8 bytes is not supported.
"""

import math

import ml_dtypes
import numpy as np

from mjax.convert.spec import ConversionError

SCALE_SUFFIX = "weight_scale_inv"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_block_size(hf: dict) -> tuple[int, int] | None:
    """The (rows, cols) of a scale block from config.json's quantization_config; None when not quantized."""
    q = hf.get("quantization_config")
    if not q:
        return None
    wanted = (("quant_method", "fp8"), ("fmt", "e4m3"), ("activation_scheme", "dynamic"))
    for key, value in wanted:
        if q.get(key, value) != value:
            raise ConversionError(f"config.json quantization_config {key}={q.get(key)!r} is not supported (mjax reads "
                                  "FP8 e4m3 weights with block scales, quant_method fp8)")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or min(block) < 1:
        raise ConversionError(f"config.json quantization_config weight_block_size={block!r}: expected [rows, cols]")
    return int(block[0]), int(block[1])


def dequantize_blocks(w, scale_inv, block: tuple[int, int]):
    """fp8 [O, I] times its block scales [ceil(O / bo), ceil(I / bi)] -> bf16 [O, I] (the product in fp32)."""
    o, i = w.shape
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)[:o, :i]  # -> [O, I]
    return (w.astype(np.float32) * full).astype(ml_dtypes.bfloat16)


class DequantizingReader:
    """A SafetensorsReader whose block-scaled FP8 weights read as bf16 and whose scales are not listed."""

    def __init__(self, reader, block: tuple[int, int]):
        self.reader, self.block, self.directory = reader, block, reader.directory
        self.scales = {}  # weight name -> its scale's name
        for name in reader.names():
            if name.endswith(SCALE_SUFFIX):
                self.scales[name[: -len(SCALE_SUFFIX)] + "weight"] = name
        for weight, scale in self.scales.items():
            if weight not in reader or reader.dtype(weight) != FP8 or len(reader.shape(weight)) != 2:
                raise ConversionError(f"{scale!r} in {self.directory} scales no 2-D float8_e4m3fn tensor {weight!r}")
            want = tuple(math.ceil(n / b) for n, b in zip(reader.shape(weight), block))
            if tuple(reader.shape(scale)) != want:
                raise ConversionError(f"{scale!r} has shape {list(reader.shape(scale))}, expected {list(want)} for "
                                      f"{weight!r} {list(reader.shape(weight))} in blocks of {list(block)}")
        unscaled = [n for n in reader.names() if reader.dtype(n) == FP8 and n not in self.scales]
        if unscaled:
            raise ConversionError(f"FP8 tensor(s) without a {SCALE_SUFFIX}: {', '.join(sorted(unscaled)[:8])}")

    def __contains__(self, name: str) -> bool:
        return name in self.reader and not name.endswith(SCALE_SUFFIX)

    def names(self) -> list[str]:
        return [n for n in self.reader.names() if not n.endswith(SCALE_SUFFIX)]

    def shape(self, name: str) -> tuple:
        return self.reader.shape(name)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16) if name in self.scales else self.reader.dtype(name)

    def get(self, name: str) -> np.ndarray:
        x = self.reader.get(name)
        if name not in self.scales:
            return x
        return dequantize_blocks(x, self.reader.get(self.scales[name]), self.block)
