"""Getting weights in: transformers folders and hub ids, the bundled GGUF models, and the parity reference."""
