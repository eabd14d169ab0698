"""Scoring what a run produced: GSM8K through lm-eval, held-out loss, on the CPU and on TPU."""
