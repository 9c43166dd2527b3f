"""Triton GPU kernels, each with the same signature as its pure-PyTorch twin in
kiln.kernels.reference, so either module can be passed wherever an `ops` module is expected.

Importing this package imports triton: do it only when the triton backend is chosen. On a machine
without a GPU the kernels run under the interpreter when TRITON_INTERPRET=1 is set before import.
"""

from kiln.kernels.triton.argmax import argmax
from kiln.kernels.triton.clamped_swiglu import clamped_swiglu
from kiln.kernels.triton.copy_blocks import copy_kv_blocks
from kiln.kernels.triton.decode_attention import paged_decode_attention
from kiln.kernels.triton.fp8_block_gemm import (
    fp8_block_linear,
    fp8_block_matmul,
    quantize_fp8_groups,
)
from kiln.kernels.triton.fp8_gemm import quantize_fp8
from kiln.kernels.triton.fused_moe import fused_moe, fused_moe_int4
from kiln.kernels.triton.int4_gemm import dequantize_int4, int4_linear
from kiln.kernels.triton.int8_gemm import int8_linear, int8_matmul, quantize_int8
from kiln.kernels.triton.lora import lora_expand, lora_shrink
from kiln.kernels.triton.mla_decode import mla_decode_attention
from kiln.kernels.triton.moe_decode import (
    fused_moe_decode,
    fused_moe_decode_routed,
    fused_moe_int4_decode,
)
from kiln.kernels.triton.moe_fp8 import fused_moe_fp8
from kiln.kernels.triton.moe_fp8_block import fused_moe_fp8_block
from kiln.kernels.triton.moe_router import moe_route
from kiln.kernels.triton.prefill_attention import paged_prefill_attention
from kiln.kernels.triton.qk_norm_rotary import qk_norm_rotary_write_kv
from kiln.kernels.triton.qkv_rotary import add_rms_norm_qkv_rotary_write_kv
from kiln.kernels.triton.rms_norm import (
    add_rms_norm_quant_fp8,
    add_rms_norm_quant_int8,
    fused_add_rms_norm,
    layer_norm,
    rms_norm,
)
from kiln.kernels.triton.rotary import rotary_embedding_write_kv
from kiln.kernels.triton.silu_mul import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_quant_fp8,
    gelu_tanh_and_mul_quant_int8,
    silu_and_mul,
    silu_and_mul_quant_fp8,
    silu_and_mul_quant_int8,
)
from kiln.kernels.triton.small_batch_linear import (
    add_rms_norm_linear,
    add_rms_norm_linear_silu_mul,
    add_rms_norm_linear_silu_mul_fp8,
    fp8_linear,
    fp8_matmul,
    linear,
)
from kiln.kernels.triton.w8a16_gemm import w8a16_linear

__all__ = [
    "add_rms_norm_linear",
    "add_rms_norm_linear_silu_mul",
    "add_rms_norm_linear_silu_mul_fp8",
    "add_rms_norm_qkv_rotary_write_kv",
    "add_rms_norm_quant_fp8",
    "add_rms_norm_quant_int8",
    "argmax",
    "clamped_swiglu",
    "copy_kv_blocks",
    "dequantize_int4",
    "fp8_block_linear",
    "fp8_block_matmul",
    "fp8_linear",
    "fp8_matmul",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_decode",
    "fused_moe_decode_routed",
    "fused_moe_fp8",
    "fused_moe_fp8_block",
    "fused_moe_int4",
    "fused_moe_int4_decode",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_quant_fp8",
    "gelu_tanh_and_mul_quant_int8",
    "int4_linear",
    "int8_linear",
    "int8_matmul",
    "layer_norm",
    "linear",
    "lora_expand",
    "lora_shrink",
    "mla_decode_attention",
    "moe_route",
    "paged_decode_attention",
    "paged_prefill_attention",
    "qk_norm_rotary_write_kv",
    "quantize_fp8",
    "quantize_fp8_groups",
    "quantize_int8",
    "rms_norm",
    "rotary_embedding_write_kv",
    "silu_and_mul",
    "silu_and_mul_quant_fp8",
    "silu_and_mul_quant_int8",
    "w8a16_linear",
]
