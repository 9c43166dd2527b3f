"""EAGLE-3's tap: every target forward's auxiliary hidden states, handed to the proposer."""

from __future__ import annotations

from typing import Any

import torch

from kiln.runtime.in_flight import InFlightStep
from kiln.runtime.input_batch import CachedRequestState, PackedBatch
from kiln.runtime.step_hooks.base import StepHook
from kiln.spec_decode.proposer import Proposer


class TargetHiddenStateTap(StepHook):
    """For a proposer that `uses_target_hidden_states` (EAGLE-3): the target writes the states
    of a few layers into `model.aux_hidden_states` each forward, and the proposer keeps the rows
    of the positions each request computed, before their computed-token counts move on."""

    def __init__(self, proposer: Proposer, model: Any) -> None:  # the runner's model
        self.proposer, self.model = proposer, model

    def after_forward(
        self,
        step: InFlightStep,
        states: list[CachedRequestState],
        batch: PackedBatch,
        hidden: torch.Tensor,
    ) -> None:
        self.proposer.record_target_hidden_states(
            states, batch.num_scheduled, batch.query_start_loc_np, self.model.aux_hidden_states
        )
