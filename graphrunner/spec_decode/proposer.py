"""The n-gram proposer as the runner uses it: after a step's post-update, prompt lookup over each scheduled row's
device history, and the drafts written into the row's history tail (read by the next verify step's prep kernel).
"""

from __future__ import annotations

import torch

from graphrunner.spec_config import SpeculativeConfig
from graphrunner.spec_decode.ngram import propose_ngram
from graphrunner.spec_decode.update import write_drafts
from graphrunner.state_table import StateTable


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, state: StateTable, use_triton: bool) -> None:
        self.config = config
        self.state = state
        self.use_triton = use_triton

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def propose(self, idx_mapping: torch.Tensor) -> None:
        """idx_mapping [B] int32: rows whose history just changed (padding rows may repeat)."""
        c, st = self.config, self.state
        drafts, num_drafts = propose_ngram(idx_mapping, st.token_ids, st.num_tokens, c.prompt_lookup_min,
                                           c.prompt_lookup_max, c.num_speculative_tokens, self.use_triton)
        write_drafts(idx_mapping, drafts, num_drafts, st.token_ids, st.num_tokens, st.num_drafts, self.use_triton)
