"""One small file of a dataset preset's Hub source, downloaded through huggingface_hub: the Hub step
of `doit vm_run --rehearse` (mtpipe.cloud.lifecycle.rehearsal), run on the VM in the shipped repo.

    python -m mtpipe.data.hub_file --dataset ultrachat-200k --filename README.md

HF_TOKEN and HF_ENDPOINT come from the environment; a token the Hub refuses fails here, also for an
open repo. Exit 0 with one line naming the file, or 1 with the Hub's answer and the fix. (Not in
mtpipe.data.hub: hf_download's view fingerprints that module, and the rehearsal changes no stage.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import yaml
from huggingface_hub.errors import HfHubHTTPError

CONF = Path(__file__).resolve().parents[2] / "conf" / "dataset"


def download(dataset: str, filename: str) -> str:
    """Download ``filename`` of conf/dataset/<dataset>.yaml's Hub source at its pinned revision into a
    temporary directory; the line that says what came."""
    source = yaml.safe_load((CONF / f"{dataset}.yaml").read_text())["source"]
    token = os.environ.get("HF_TOKEN") or False   # False: never a token file on disk
    with tempfile.TemporaryDirectory() as tmp:
        path = huggingface_hub.hf_hub_download(source["repo_id"], filename, repo_type="dataset",
                                               revision=source["revision"], token=token, local_dir=tmp)
        size = Path(path).stat().st_size
    return (f"Hub download ok: {filename} of dataset {source['repo_id']} at {source['revision'][:12]}, {size} bytes "
            f"(huggingface_hub {huggingface_hub.__version__}, {huggingface_hub.constants.ENDPOINT})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="conf/dataset/<this>.yaml, a Hub source")
    parser.add_argument("--filename", required=True, help="a file of that repo at the pinned revision")
    opts = parser.parse_args()
    try:
        print(download(opts.dataset, opts.filename), flush=True)
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "no answer"
        print(f"Hub download failed (HTTP {status}): {err}\n  fix: HTTP 401 is a token the Hub refuses (export a valid "
              "read token as HF_TOKEN); otherwise the VM's route to the Hub (external IP or Cloud NAT)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
