"""Hugging Face Clover checkpoint -> GGUF converter."""
