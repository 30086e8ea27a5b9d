"""GGUF files: the bounded reader every model and adapter load goes through."""
