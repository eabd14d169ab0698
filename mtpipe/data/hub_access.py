"""Whether HF_TOKEN's account may download a gated repo, asked before any VM exists (the checks before
spending, mtpipe.cloud.checks.project). Apart from mtpipe/data/hub.py so that the hf_download stage's code,
and so its address, does not carry a check only the laptop runs."""

from __future__ import annotations

import os
from collections.abc import Mapping

from huggingface_hub import HfApi
from huggingface_hub.errors import GatedRepoError

from mtpipe.data.hub import _endpoint, _hub_errors, _hub_source, repo_url
from mtpipe.errors import ConfigError


def check_access(source: Mapping, repo_type: str) -> None:
    """HF_TOKEN's account may download a pinned gated repo: the Hub's auth check (``HfApi.auth_check``:
    GET /api/<type>s/<repo>/auth-check with the token) answers GatedRepoError while its license is not
    accepted (or a manual approval is pending). The token goes in the request header only."""
    repo_id, revision = _hub_source(source, repo_type)
    token = os.environ.get("HF_TOKEN") or False  # False: no token file
    with _hub_errors(repo_id, revision, repo_type):
        try:
            HfApi(endpoint=_endpoint(), token=token).auth_check(repo_id, repo_type=repo_type, token=token)
        except GatedRepoError as err:
            status = err.response.status_code if err.response is not None else "?"
            raise ConfigError(
                "HF_TOKEN",
                f"the account of HF_TOKEN may not download the gated {repo_type} {repo_id} (the Hub's auth check "
                f"answered {status}: its license is not accepted, or the authors have not approved the request yet)",
                f"accept the license at {repo_url(repo_id, repo_type)} while logged in as the token's account (and "
                "wait for the approval if the page says the authors review requests), or export a token of an "
                "account that has access",
            ) from None
