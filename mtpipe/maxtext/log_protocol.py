"""The lines the project's MaxText adapter adds to a training log, defined once: the adapter
(:mod:`mtpipe.maxtext.adapter.training`) writes them and :mod:`mtpipe.maxtext.training_logs` parses them."""

# train_rl's eval, per prompt: right samples / samples (adapter patch 12), e.g. `... per prompt: 2/4 0/4 3/4`
EVAL_SAMPLES_LINE = "mtpipe eval: right samples per prompt:"
