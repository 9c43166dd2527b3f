"""Structured output: a grammar (JSON schema, regex, choice, EBNF) constrains what is sampled.

xgrammar compiles each distinct spec once per tokenizer (compiler.py, cached by the spec's key);
each request gets its own matcher, which accepts the request's tokens as they come back and
fills its row of the step's allowed-token bitmask (matchers.py). The runner fills the bitmask
right after launching the forward, so on a GPU the host work overlaps the model, and hands it to
the sampler as `SamplingMetadata.token_bitmask` (TokenBitmaskProcessor applies it). xgrammar is
imported only when a request asks for a grammar.
"""

from kiln.structured_output.compiler import GrammarCompilerCache, compiler_for
from kiln.structured_output.matchers import GrammarBatch

__all__ = ["GrammarBatch", "GrammarCompilerCache", "compiler_for"]
