"""lmiserve's own forward of Llama-family decoders (`fast_llama`): the weights' layout (`llama_layout`), tensor-parallel
sharding (`sharding`), quantized linears (`quantize`), the CPU products (`cpu_gemm`, `skinny_gemm`) and their start-up
autotune (`autotune`)."""
