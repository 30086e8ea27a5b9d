"""LoRA: adapters (load and validate), their names, the mixes the forward pass runs
with, and exports of a mix."""
