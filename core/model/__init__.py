"""The model: config, the fused weight layout, weights, products, attention, KV cache
and one forward pass per architecture (llama.py), on shared primitives."""
