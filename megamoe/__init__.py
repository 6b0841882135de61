"""megamoe: DeepGEMM's Mega MoE (one fused expert-parallel MoE layer on symmetric memory), re-created in Triton.

Public API (mirrors DeepGEMM's names where they exist)::

    Layout, get_num_max_pool_tokens, get_num_padded_sf_pool_tokens        # megamoe.layout
    per_token_cast_to_fp8, per_token_cast_to_fp4, transform_weights_for_mega_moe, TransformedWeights  # megamoe.quant
    reference_mega_moe, reference_mega_moe_ep                               # megamoe.reference
    SymmBuffer, get_symm_buffer_for_mega_moe                                # megamoe.symm
    launch                                                                  # megamoe.launch
    fp8_fp4_mega_moe, MegaMoE                                               # megamoe.ops
    fp8_mega_moe, get_symm_buffer_for_mega_moe_sm90                         # megamoe.ops_fp8 (SM90 FP8 x FP8)
    per_token_cast_to_fp8_128, per_block_cast_to_fp8, transform_weights_for_mega_moe_sm90,
        TransformedWeightsSM90                                              # megamoe.quant_fp8
    reference_fp8_mega_moe, reference_fp8_mega_moe_ep                       # megamoe.reference

Attributes are imported lazily and CuPy is never imported on CPU paths. Importing megamoe on a machine without
CUDA switches Triton to its interpreter (``TRITON_INTERPRET=1``); the kernels need that before Triton itself is
imported (``megamoe.env`` explains why and what happens otherwise).
"""
from __future__ import annotations

import importlib

from megamoe.env import ensure_interpreter_if_no_cuda as _ensure_interpreter

_ensure_interpreter()

__version__ = "0.1.0"

_EXPORTS = {
    "Layout": "layout",
    "get_num_max_pool_tokens": "layout",
    "get_num_padded_sf_pool_tokens": "layout",
    "per_token_cast_to_fp8": "quant",
    "per_token_cast_to_fp4": "quant",
    "transform_weights_for_mega_moe": "quant",
    "TransformedWeights": "quant",
    "reference_mega_moe": "reference",
    "reference_mega_moe_ep": "reference",
    "SymmBuffer": "symm",
    "get_symm_buffer_for_mega_moe": "symm",
    "launch": "launch",
    "fp8_fp4_mega_moe": "ops",
    "MegaMoE": "ops",
    "fp8_mega_moe": "ops_fp8",
    "get_symm_buffer_for_mega_moe_sm90": "ops_fp8",
    "per_token_cast_to_fp8_128": "quant_fp8",
    "per_block_cast_to_fp8": "quant_fp8",
    "transform_weights_for_mega_moe_sm90": "quant_fp8",
    "TransformedWeightsSM90": "quant_fp8",
    "reference_fp8_mega_moe": "reference",
    "reference_fp8_mega_moe_ep": "reference",
    "describe_environment": "env",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"megamoe.{_EXPORTS[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
