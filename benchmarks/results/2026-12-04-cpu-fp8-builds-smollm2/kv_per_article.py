from kiln.llm import LLM
from kiln.builder.accuracy import HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import rolling_perplexity
docs = wikitext_articles(HELD_OUT_FILE, 3)
for name, kw in [("source", {}), ("unscaled fp8 kv", {"kv_cache_dtype": "fp8"}), ("scaled build", {"path": "/tmp/builds/kv8"})]:
    path = kw.pop("path", None)
    llm = LLM(path, enable_prefix_caching=False, **kw) if path else LLM(enable_prefix_caching=False, **kw)
    per = [rolling_perplexity(llm, [d]).word_perplexity for d in docs]
    print(name, [round(p, 4) for p in per], round(rolling_perplexity(llm, docs).word_perplexity, 4), flush=True)
    llm.shutdown()
