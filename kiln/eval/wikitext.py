"""The `wikitext` task: lm-eval's WikiText-2 document-level rolling perplexity.

lm-eval scores `EleutherAI/wikitext_document_level` pages: the split's lines joined into one
document per article (a new one at each level-1 heading " = Title = "), each detokenized by
`wikitext_detokenizer` before scoring, while words and bytes are counted in the page as it was
(lm_eval/tasks/wikitext/preprocess_wikitext.py). Both steps are reproduced here.

The shared data (`wikitext-2/test.txt`) is WikiText-2's tokenized release (it holds `<unk>`), not
the raw one lm-eval's `wikitext-2-raw-v1` config reads: scores match lm-eval's run on the same
file (a local task over these pages), not published wikitext-2-raw numbers.
"""

from __future__ import annotations

import os
import re

from kiln.errors import EvalError
from kiln.eval.perplexity import rolling_perplexity

SPLITS = {"test": "test.txt", "validation": "valid.txt"}


def split_documents(text: str) -> list[str]:
    """The article pages of a WikiText split file, as the document-level dataset builds them:
    a line that reads "= Title =" once "= =" runs are closed up starts a page; blank pages are
    dropped; lines keep their spaces and are joined with newlines."""
    pages: list[str] = []
    lines: list[str] = []
    for line in text.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            page = "\n".join(lines)
            if page.strip():
                pages.append(page)
            lines = []
        lines.append(line)
    page = "\n".join(lines)
    if page.strip():
        pages.append(page)
    return pages


def wikitext_detokenizer(string: str) -> str:
    """lm-eval's `wikitext_detokenizer`, step for step (its quirks, such as the regex on
    literal slashes, kept: the scores must be lm-eval's)."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    for mark in (":", ";", ".", "!", "?", ","):
        string = string.replace(f" {mark} ", f"{mark} ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def load_documents(data_dir: str, split: str = "test") -> list[str]:
    """The pages (not detokenized) of `data_dir/wikitext-2/<split file>`."""
    path = os.path.join(data_dir, "wikitext-2", SPLITS[split])
    if not os.path.isfile(path):
        raise EvalError(f"wikitext: {path} not found (WikiText-2's {split} split)")
    with open(path, encoding="utf-8") as f:
        return split_documents(f.read())


def run(
    llm, data_dir: str, limit: int | None = None, show_progress: bool = True, **_: object
) -> dict[str, float]:
    """lm-eval's three wikitext metrics (and token perplexity) on the first `limit` pages of
    the test split; a bar on stderr moves as each window is scored (the whole split takes
    minutes on a CPU)."""
    pages = load_documents(data_dir)[:limit]
    texts = [wikitext_detokenizer(p) for p in pages]
    result = rolling_perplexity(llm, texts, counted_texts=pages, show_progress=show_progress)
    return {
        "word_perplexity": result.word_perplexity,
        "byte_perplexity": result.byte_perplexity,
        "bits_per_byte": result.bits_per_byte,
        "token_perplexity": result.token_perplexity,
        "num_documents": result.num_documents,
        "num_tokens": result.num_tokens,
    }
