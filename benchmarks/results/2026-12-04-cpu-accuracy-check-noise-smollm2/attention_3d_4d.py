import math, sys, torch, torch.nn.functional as F
from kiln.kernels import reference
from kiln.llm import LLM
from kiln.builder.accuracy import HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import rolling_perplexity
new = reference.paged_prefill_attention
orig_sdpa = F.scaled_dot_product_attention
def sdpa3(q, k, v, **kw):  # the old 3-D call: drop the batch dim of one
    if q.dim() == 4 and q.shape[0] == 1 and k.shape[0] == 1 and kw.get("attn_mask") is None or (q.dim()==4 and q.shape[0]==1 and k.shape[0]==1 and kw.get("attn_mask") is not None and kw["attn_mask"].dim()==2):
        return orig_sdpa(q[0], k[0], v[0], **kw)[None]
    return orig_sdpa(q, k, v, **kw)
docs = wikitext_articles(HELD_OUT_FILE, 3)
for path in ["/tmp/eng1", None]:
    llm = LLM(path, enable_prefix_caching=False) if path else LLM(enable_prefix_caching=False)
    for name in ("4d", "3d"):
        reference.F.scaled_dot_product_attention = sdpa3 if name == "3d" else orig_sdpa
        per = [rolling_perplexity(llm, [d]).word_perplexity for d in docs]
        allp = rolling_perplexity(llm, docs).word_perplexity
        print(path or "source", name, [round(p, 4) for p in per], round(allp, 4), flush=True)
    llm.shutdown()
