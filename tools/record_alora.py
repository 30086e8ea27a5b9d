"""Record llama-server's greedy tokens under an activated LoRA (aLoRA), as reference
data for Mixdesk's (tests/test_alora.py, core/lora/alora.py).

    python tools/record_alora.py --llama-server-bin ~/.cache/mixdesk-llamacpp/build/bin/llama-server

Writes ``tests/data/llamacpp/adapters/lora_attn_alora.gguf``: the reference adapter
``lora_attn.gguf`` (random, rank 8, alpha 16, f32) with
``adapter.alora.invocation_tokens`` = the tokens of SmolLM2's assistant header
``<|im_start|>assistant\\n``, so that the adapter switches on where the assistant's turn
starts. Then serves the dequantized float32 SmolLM2 (tools/interop.py writes it) with a
float32 KV cache, ``--lora`` that file and ``--lora-init-without-apply``, and records,
with ``"lora": [{"id": 0, "scale": 1}]``, ``temperature`` 0, ``ignore_eos``,
``n_probs`` 10 and 16 tokens:

* ``cases``: prompts that invoke it at the end, in the middle and twice, one that never
  does (llama-server then runs the base model) and the same with the adapter at scale
  0 (the base, for comparison), each with ``cache_prompt`` false;
* ``reuse``: the base model first on a chat prompt, then the aLoRA on that prompt plus
  the assistant header, both with ``cache_prompt`` true: llama-server keeps the base's
  keys and values up to the invocation (``timings.cache_n``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import interop  # noqa: E402

INVOCATION = [1, 520, 9531, 198]  # <|im_start|> assistant \n (SmolLM2's tokenizer)
SOURCE = "lora_attn.gguf"
ADAPTER = "lora_attn_alora.gguf"
OUT_JSON = "smollm2_f32_alora.json"


def chat(system: str, user: str) -> list[int]:
    """SmolLM2's chat prompt up to the assistant header (not included), as token ids."""
    from core.gguf.reader import GGUFFile
    from core.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(
        GGUFFile(interop.work_dir() / "SmolLM2-135M-Instruct.F32.gguf").metadata
    )
    text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
    return tok.encode(text, add_special=False, parse_special=True)


def write_alora(src: Path, out: Path, invocation: list[int]) -> None:
    """``src`` (a llama.cpp LoRA GGUF) again, with aLoRA invocation tokens added."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, arch="llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    alpha = r.fields["adapter.lora.alpha"]
    w.add_float32("adapter.lora.alpha", float(alpha.parts[alpha.data[0]][0]))
    # llama.cpp reads the tokens as an array of uint32 and refuses any other type
    w.add_key_value(
        "adapter.alora.invocation_tokens",
        [int(t) for t in invocation],
        gguf.GGUFValueType.ARRAY,
        sub_type=gguf.GGUFValueType.UINT32,
    )
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    from tests.reference import reference_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server-bin", default=os.environ.get("MIXDESK_LLAMA_SERVER_BIN"))
    a = ap.parse_args(argv)
    f32 = interop.work_dir() / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        raise SystemExit(f"{f32} is missing: run tools/interop.py first (it writes it)")
    adapters = reference_dir() / "adapters"
    write_alora(adapters / SOURCE, adapters / ADAPTER, INVOCATION)
    binary = interop.llama_server_binary(a.llama_server_bin)

    p1 = chat("You are a helpful assistant.", "What is the capital of France?")
    p2 = chat("You are terse.", "Name three colours.")
    prompts = {
        "invoked_at_end": p1 + INVOCATION,
        "invoked_mid": p2 + INVOCATION + [378, 2988, 314],  # " The answer is"
        "invoked_twice": p1 + INVOCATION + [504, 2] + p2 + INVOCATION,
        "not_invoked": p1,
    }
    cases = []
    extra = ["--lora", str(adapters / ADAPTER), "--lora-init-without-apply"]
    with interop.llama_server(binary, f32, extra) as url:

        def complete(prompt, scale, cache_prompt=False):
            body = {"prompt": prompt, "n_predict": interop.N_PREDICT, "temperature": 0,
                    "ignore_eos": True, "cache_prompt": cache_prompt, "n_probs": 10,
                    "return_tokens": True, "lora": [{"id": 0, "scale": scale}]}  # fmt: skip
            return interop._post(f"{url}/completion", body)

        for name, prompt in prompts.items():
            for scale in (1.0, 0.0):
                r = complete(prompt, scale)
                top = [
                    [[t["id"], t["logprob"]] for t in step["top_logprobs"]]
                    for step in r["completion_probabilities"]
                ]
                cases.append({"case": name, "scale": scale, "prompt_tokens": prompt,
                              "tokens": r["tokens"], "top_logprobs": top})  # fmt: skip
                print(f"record: {name} scale {scale}: {r['tokens']}")
        base = complete(p1, 0.0, cache_prompt=True)
        then = complete(p1 + INVOCATION, 1.0, cache_prompt=True)
        reuse = {
            "base_prompt": p1,
            "base_tokens": base["tokens"],
            "alora_prompt": p1 + INVOCATION,
            "alora_tokens": then["tokens"],
            "alora_cache_n": then["timings"]["cache_n"],
            "alora_prompt_n": then["timings"]["prompt_n"],
        }
        print(f"record: reuse: cache_n {reuse['alora_cache_n']} of {len(p1) + len(INVOCATION)}")
    out = {
        "adapter": ADAPTER,
        "source": SOURCE,
        "invocation_tokens": INVOCATION,
        "n_predict": interop.N_PREDICT,
        "cases": cases,
        "reuse": reuse,
    }
    (reference_dir() / OUT_JSON).write_text(json.dumps(out, indent=1) + "\n")
    print(f"record: wrote {reference_dir() / OUT_JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
