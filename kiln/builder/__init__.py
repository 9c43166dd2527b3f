"""`kiln build`: turn an HF directory (a pre-quantized FP8 one too) or a GGUF file into an engine
directory (fused, optionally quantized weights in safetensors, tokenizer, manifest) that loads
without conversion."""
