"""Speculative decoding on the device over the state table (runner layer).

`ngram`: prompt-lookup draft kernel + reference; `proposer`: the runner's n-gram proposer (drafts into the history
tail); `layout`: a verify step's logits rows and expanded idx_mapping; `sampler`: the verify sampler (stages +
rejection); `update`: post-verify state update and draft writes; `draft_model` / `eagle`: the model-drafting
proposers (a second model; an EAGLE-1 head on the target's hidden states).
"""
