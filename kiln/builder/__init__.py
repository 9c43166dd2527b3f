"""`kiln build`: turn an HF directory or a GGUF file into an engine directory (fused, optionally
quantized weights in safetensors, tokenizer, manifest) that loads without conversion."""
