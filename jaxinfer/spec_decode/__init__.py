"""Speculative decoding: propose draft tokens cheaply, verify them all in one target step.

- ``config``: :class:`SpeculativeConfig`, what ``LLM(speculative_config=...)`` and
  ``--speculative-config`` accept (vLLM's keys).
- ``ngram``: the prompt-lookup proposer (numpy, on the host); ``device_ngram`` the same lookup
  jitted over the device's token history.
- ``draft_model``: a small model sharing the tokenizer drafts greedily on its own paged cache.
- ``eagle3`` (the head as pure functions), ``eagle3_checkpoint`` (its two checkpoint layouts),
  ``eagle3_proposer`` (drafting for the engine) and ``aux_hidden`` (the target's features, kept
  per KV slot by the runner of an engine with a head).
- ``lagged``: asynchronous verify steps: the next step's drafts and position shifts on the device.
- ``rejection``: exact verification on the device (greedy prefix match; rejection sampling).
- ``layout``: how a step with drafts lays its rows out (``num_seqs x (k + 1)`` logits rows).
- ``speculator``: the policy (who speculates, how many drafts), rollback after a verify step,
  and the acceptance counters.

docs/SPECULATIVE.md walks one verify step through the engine.
"""
