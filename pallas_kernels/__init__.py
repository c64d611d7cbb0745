"""The kernel bodies: what runs on the GPU in place of XLA's code. The model reaches them only through
``moejax.kernels`` (one module an operation plans the path from shapes, dtypes and platform, and calls
one of these or runs XLA); nothing here chooses.

Pallas, Triton backend (every kernel passes its Triton compiler parameters explicitly: compat.py; on CPU
the tests run them in the Pallas interpreter; no Mosaic GPU):

- fused_moe.py: the routed experts' MLP over rows sorted by expert (gate/up, then down), bf16;
- fused_moe_fp8.py: the same with block-FP8 weights; fp8_utils.py: the activation quantisation and FP8
  weight loads both FP8 kernels share;
- block_scaled_matmul.py: the dense block-scaled FP8 GEMM of the projections;
- paged_decode_attention.py: decode attention over the paged cache, MLA and MFA;
- flash_prefill_attention.py: causal flash attention for prefill, MLA and MFA;
- triton_fp8_dots.py: the lowering hook that puts their FP8 x FP8 dots on Hopper's wgmma
  (the ``fp8_fast_accum`` setting).

The Triton language through jax-triton (jax_triton_compat.py: the import guard and the call helper):

- triton_block_fp8.py: the block-FP8 W8A8 dense projection and routed-expert MLP;
- triton_mla_decode.py: absorbed-MLA decode over the paged latent cache.

An XLA FFI op: cublaslt_fp8_gemm.py, cuBLASLt's block-scaled FP8 GEMM (CUDA 12.9+, Hopper), built from
ffi/cuda/.
"""
