"""The build's accuracy measure on more held-out text: word perplexity of the source and of
built engines or HF checkpoints (a peer's pre-quantized one, read by kiln in float32) on the first N articles of WikiText-2's validation split (the build's own check
reads the first one), each article and all together.

    OMP_NUM_THREADS=1 python more_text.py OUT.json N ENGINE_OR_CHECKPOINT_DIR [...]
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from kiln.builder.accuracy import HELD_OUT_FILE, measuring_llm, wikitext_articles
from kiln.checkpoint.default_model import default_model_path
from kiln.eval.perplexity import count_words, prefix_token_id, token_loglikelihoods


def main(out_path: str, n: int, engines: list[str]) -> None:
    docs = wikitext_articles(HELD_OUT_FILE, n)
    result: dict = {"articles": n, "models": {}}
    t0 = time.time()
    for path in [None, *engines]:  # None: the source, as the build measures it
        # The source and the peers' checkpoints in float32, as the build reads its source;
        # a built engine carries its own dtype.
        built = path is not None and os.path.isfile(os.path.join(path, "kiln_engine.json"))
        args = {} if built else {"dtype": "float32"}
        # As rolling_perplexity scores, each article's loglikelihood kept.
        with measuring_llm(path or default_model_path(), **args) as llm:
            tokenizer = llm.get_tokenizer()
            ids = [tokenizer.encode(d, add_special_tokens=False) for d in docs]
            lls = token_loglikelihoods(llm, ids, prefix_token_id(llm))
        words = [count_words(d) for d in docs]
        whole = math.exp(-math.fsum(lls) / sum(words))
        each = [math.exp(-ll / w) for ll, w in zip(lls, words)]
        name = path or "source"
        result["models"][name] = {"word_perplexity": whole, "per_article": each}
        src = result["models"]["source"]
        line = {
            "increase_pct": 100 * (whole / src["word_perplexity"] - 1),
            "per_article_increase_pct": [
                100 * (e / s - 1) for e, s in zip(each, src["per_article"])
            ],
        }
        result["models"][name].update(line)
        print(name, round(whole, 3), f"{line['increase_pct']:+.2f}%",
              [round(p, 2) for p in line["per_article_increase_pct"]],
              round(time.time() - t0), flush=True)  # fmt: skip
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
