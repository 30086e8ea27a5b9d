"""Mixdesk's engine. Importing it first sets what must be set before numpy loads its
OpenBLAS, for every entry point (main.py, the headless server, the bench, the tests).

OPENBLAS_THREAD_TIMEOUT: after a BLAS call OpenBLAS's threads spin for 2**n cycles
before they sleep, 2**28 (~0.1 s) by default. A prompt's prefill runs on BLAS and the
next decode steps on numba's kernel threads, so for ~0.1 s after each prefill the two
pools fought for the cores: on SmolLM2 the first step after switching back to a mix
(one token over a cached prompt) took 69-116 ms instead of 23-35, and a 64-token decode
after a 200-token prompt read 64.7-87.8 tok/s against 77.8-89.9 with 2**20 cycles
(~0.35 ms; alternating processes, 2026-12-07). 2**16 cost the float32 path a tenth of
its decode (its BLAS threads then slept between a token's gemvs), 2**20 nothing. A
value the user set is kept."""

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")
