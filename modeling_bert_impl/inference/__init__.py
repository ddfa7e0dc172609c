"""The CPU inference engine, called by name beside the model: `optimize_for_inference`, `quantize_for_inference`,
`compile_for_inference`. Each gives an inference model whose weights are fixed at that call; the model it was given
stays a plain, trainable transformers model."""

from .compiled_encoder import compile_for_inference
from .packed_linear import cpu_bf16_units
from .quantization import quantize_for_inference
from .serving import optimize_for_inference
from .threads import free_thread_pool

__all__ = ["optimize_for_inference", "quantize_for_inference", "compile_for_inference", "cpu_bf16_units",
           "free_thread_pool"]
