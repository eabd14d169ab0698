"""The checks before spending that only Google answers: Compute, IAM, OS Login, quotas, org policies."""
