"""Each engine's per-token damage against its source on the build's check text: the mean
|change| of each predicted token's log-probability (the first three held-out WikiText-2 articles,
rolling windows as the check scores them), besides the check's word perplexity. Unlike the
perplexity's signed mean, it does not let errors cancel.

    OMP_NUM_THREADS=2 python damage.py OUT.json ENGINE_DIR [ENGINE_DIR ...]"""
import json, math, sys
import torch
from kiln.builder.accuracy import HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, scored_windows
from kiln.llm import LLM


def logprobs(llm, ids):
    out = []
    for _, lps in scored_windows(llm, ids, prefix_token_id(llm)):
        out += lps
    return torch.tensor(out, dtype=torch.float64)


docs = wikitext_articles(HELD_OUT_FILE, 3)
words = sum(count_words(d) for d in docs)
source = LLM(dtype="float32", enable_prefix_caching=False)  # the embedded SmolLM2 GGUF
ids = [source.get_tokenizer().encode(d, add_special_tokens=False) for d in docs]
want = logprobs(source, ids)
del source
result = {"tokens": len(want), "source_word_perplexity": math.exp(-float(want.sum()) / words)}
for path in sys.argv[2:]:
    got = logprobs(LLM(path, enable_prefix_caching=False), ids)
    ppl = math.exp(-float(got.sum()) / words)
    result[path] = {
        "word_perplexity_increase_pct": 100 * (ppl / result["source_word_perplexity"] - 1),
        "mean_abs_logprob_change": float((got - want).abs().mean()),
    }
    print(path, json.dumps(result[path]), flush=True)
    json.dump(result, open(sys.argv[1], "w"), indent=1)
