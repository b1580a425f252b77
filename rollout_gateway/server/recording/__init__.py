"""Recording: one trajectory step per turn, stored in compact delta form.

The recorder (:mod:`.recorder`) keeps each step as what it adds to the previous one: the
new messages (:mod:`.history`), the new token ids of each branch
(:mod:`.token_branches`), the prompt's ids read only past the previous prompt
(:mod:`.prompt_ids`), compared by per-process digests (:mod:`.digests`).
"""
