"""The formats kestrel reads and writes: Hugging Face directories (safetensors, config.json, tokenizer, chat template), GGUF files, kestrel's q8, and the choice of loader."""
