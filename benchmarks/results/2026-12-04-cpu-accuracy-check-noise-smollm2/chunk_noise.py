import json, statistics
from kiln.llm import LLM
from kiln.builder.accuracy import HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import rolling_perplexity
docs = wikitext_articles(HELD_OUT_FILE, 4)
src = {}
llm = LLM(enable_prefix_caching=False)
for n in (1, 3, 4):
    src[n] = rolling_perplexity(llm, docs[:n]).word_perplexity
llm.shutdown()
rows = []
for budget in (512, 1024, 2048, 3072, 4096):
    llm = LLM("/tmp/eng1", enable_prefix_caching=False, max_num_batched_tokens=budget)
    inc = {n: 100 * (rolling_perplexity(llm, docs[:n]).word_perplexity / src[n] - 1) for n in (1, 3, 4)}
    llm.shutdown()
    rows.append(inc)
    print(budget, {n: round(v, 3) for n, v in inc.items()}, flush=True)
for n in (1, 3, 4):
    vals = [r[n] for r in rows]
    print(n, "articles: increase min", round(min(vals), 3), "max", round(max(vals), 3), "spread", round(max(vals) - min(vals), 3), "stdev", round(statistics.stdev(vals), 3))
json.dump({"source": src, "rows": rows}, open("/tmp/noise2.json", "w"))
