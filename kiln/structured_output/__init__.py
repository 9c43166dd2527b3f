"""Structured output: a grammar (JSON schema, regex, choice, EBNF) constrains what is sampled.

xgrammar compiles each distinct spec once per tokenizer (compiler.py, cached by the spec's key);
each request gets its own matcher, which accepts the request's tokens as they come back and
fills its row of the step's allowed-token bitmask (matchers.py). A worker fills a step's mask
while the device runs its forward and the runner's thread goes on with the engine loop; the
runner waits for it when it launches the step's sampler (the next submit or collect) and hands
it over as `SamplingMetadata.token_bitmask` (TokenBitmaskProcessor applies it). xgrammar is
imported only when a request asks for a grammar. A request's grammar compiles on a background
thread while the request waits out of scheduling (waitlist.py): the engine serves the others.
"""

from kiln.structured_output.compiler import GrammarCompilerCache, compiler_for
from kiln.structured_output.matchers import GrammarBatch
from kiln.structured_output.waitlist import Failed, GrammarWaitlist

__all__ = ["Failed", "GrammarBatch", "GrammarCompilerCache", "GrammarWaitlist", "compiler_for"]
