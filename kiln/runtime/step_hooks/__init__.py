"""The model runner's features, each a StepHook the runner calls at fixed points of a step
(base.py says which and when)."""

from kiln.runtime.step_hooks.base import StepHook, StepHooks
from kiln.runtime.step_hooks.beam_top_k import BeamTopKRows
from kiln.runtime.step_hooks.eagle_tap import TargetHiddenStateTap
from kiln.runtime.step_hooks.grammar_mask import GrammarMask
from kiln.runtime.step_hooks.prompt_logprobs import PromptLogprobs
from kiln.runtime.step_hooks.speculation import DraftVerification
from kiln.runtime.step_hooks.step_timer import TRACE_COLUMNS, StepTimer

__all__ = [
    "TRACE_COLUMNS",
    "BeamTopKRows",
    "DraftVerification",
    "GrammarMask",
    "PromptLogprobs",
    "StepHook",
    "StepHooks",
    "StepTimer",
    "TargetHiddenStateTap",
]
