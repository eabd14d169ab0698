"""The Cloud TPU API (tpu.googleapis.com/v2) as a provider: queued resources and their nodes (the route of TPU v5e)."""
