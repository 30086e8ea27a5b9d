"""tools/interop.py's Mixdesk side, on the real SmolLM2 and the reference adapters: the
part of `make interop` that runs without llama-server or PyTorch, so an engine API
change that breaks the tool fails here, not first in a 25-minute interop run."""

from tools import interop


def test_engine_side_builds_mixes_and_decodes(smollm_path):
    eng, ids = interop.load_engine(smollm_path)
    try:
        assert sorted(ids) == sorted(interop.ADAPTERS)
        plist = interop.prompts()
        assert plist and all(plist)
        base, _ = interop.engine_mix(ids, {}, None)
        for name, scales, merge in interop.MIXES:  # every mix builds (TIES's merge spec too)
            mix, spec = interop.engine_mix(ids, scales, merge)
            assert (spec is not None) == (merge is not None), name
        linear, _ = interop.engine_mix(ids, interop.MIXES[0][1], interop.MIXES[0][2])
        plain = interop.greedy(eng, base, plist[0])
        assert len(plain) == interop.N_PREDICT
        logits = interop.all_logits(eng, linear, plist[0])  # (T, vocab)
        assert logits.shape == (len(plist[0]), eng.config.vocab_size)
    finally:
        eng.stop()
