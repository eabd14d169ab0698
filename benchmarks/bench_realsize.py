"""DVC at real checkpoint size, each step side by side with the plain tool: prints one table.

A synthetic MaxText checkpoint in the pipeline's `plain` zarr format, built from gemma-3-4b's real
tensor inventory (tests/fixtures/gemma-3-4b-it/tensors.json) in float32: about 17.2 GB at
`--size full`, every tensor scaled down evenly (same files, smaller chunks) below that. Its bytes
are random (incompressible). Rows, DVC vs plain tool:

* hashing: `dvc add --no-commit`, cold (fresh state db, per `core.checksum_jobs`) and warm (state db)
  vs `md5sum` over all files, serial and with `xargs -P <cores>`;
* committing into the cache (`dvc commit`) per cache type vs `cp -al` / `cp -r`;
* checking out from the cache (`dvc checkout`) per cache type vs `cp -al` / `cp -r`;
* per `--jobs`: `dvc push -j` / `dvc status -c` / `dvc pull -j` to a loopback GCS emulator vs
  google-cloud-storage uploads / a listing / downloads of the same files on as many threads.

The last columns put each DVC time, scaled linearly to the full size, against the tutorial's stage
times on v6e-8 (conversion about 300 s, training about 600 s). Files just written are in the page
cache (dropping it needs root), for DVC and the plain tool alike.

Everything lives in a temporary directory under --workdir, deleted at the end (also on failure).
At full size on 2 shared cores it took 26 min with one --jobs value and 36 min with two (each adds
two uploads and two downloads of 17.2 GB through the emulator); results: docs/remote-and-cache.md.
Usage: python benchmarks/bench_realsize.py [--size 1GiB|full] [--jobs 4,16] [--checksum-jobs 1,2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench_dvc import GiB, MiB, PROJECT, disk_used, dvc, make_repo, markdown_table, parse_size, progress, run, timed

sys.path.insert(0, str(PROJECT / "tests"))
from fakes.gcs_emulator import GcsEmulator, add_dvc_remote, dvc_env, running_emulator  # noqa: E402

INVENTORY = PROJECT / "tests" / "fixtures" / "gemma-3-4b-it" / "tensors.json"
STAGE_SECONDS = {"conversion": 300, "training": 600}  # the tutorial's stage times on v6e-8
DEVICES = 16  # the conversion's simulated devices: large tensors are written as 16 chunk files
SCAN_BLOCK, SCAN_REPEATS = 6, 5  # gemma-3 scans 5 blocks of 6 layers; layers 30-33 are the remainder
FREE_DISK_FACTOR = 3.5  # at most 3 copies at once (e.g. DVC's and the plain upload + a download), + margin
CORES = os.cpu_count() or 1
# Hugging Face module names -> MaxText's, for the text decoder's layers.
MAXTEXT_NAMES = {
    "input_layernorm.weight": "pre_self_attention_norm.scale",
    "post_attention_layernorm.weight": "post_self_attention_norm.scale",
    "pre_feedforward_layernorm.weight": "pre_ffw_norm.scale",
    "post_feedforward_layernorm.weight": "post_ffw_norm.scale",
    "mlp.gate_proj.weight": "mlp.wi_0.kernel",
    "mlp.up_proj.weight": "mlp.wi_1.kernel",
    "mlp.down_proj.weight": "mlp.wo.kernel",
    "self_attn.q_proj.weight": "self_attention.query.kernel",
    "self_attn.k_proj.weight": "self_attention.key.kernel",
    "self_attn.v_proj.weight": "self_attention.value.kernel",
    "self_attn.o_proj.weight": "self_attention.out.kernel",
    "self_attn.q_norm.weight": "self_attention.query_norm.scale",
    "self_attn.k_norm.weight": "self_attention.key_norm.scale",
}


# ------------------------------------------------------------------------ synthetic checkpoint


def maxtext_tensors() -> dict[str, list[int]]:
    """gemma-3-4b in MaxText's scanned layout: directory name -> float32 shape.

    Text layers 0-29 are stacked per position in the 6-layer block (5 repeats on axis 1), layers
    30-33 stay single (`layers_remainder`); the vision tower and projector keep one tensor each.
    """
    tensors: dict[str, list[int]] = {}
    for hf_name, (_, shape) in json.loads(INVENTORY.read_text())["tensors"].items():
        parts = hf_name.split(".")
        if hf_name.startswith("language_model.model.layers."):
            layer, module = int(parts[3]), ".".join(parts[4:])
            module = MAXTEXT_NAMES.get(module, module)
            if layer < SCAN_BLOCK * SCAN_REPEATS:
                name = f"decoder.layers.layers_{layer % SCAN_BLOCK}.{module}"
                shape = [*shape[:1], SCAN_REPEATS, *shape[1:]]
            else:
                name = f"decoder.layers_remainder.layers_{layer - SCAN_BLOCK * SCAN_REPEATS}.{module}"
            tensors.setdefault(name, shape)
        elif hf_name == "language_model.model.embed_tokens.weight":
            tensors["token_embedder.embedding"] = shape
        elif hf_name == "language_model.model.norm.weight":
            tensors["decoder.decoder_norm.scale"] = shape
        else:
            tensors[hf_name.replace("vision_tower.vision_model.", "vision_encoder.")] = shape
    return {f"params.params.{name}": shape for name, shape in tensors.items()}


def full_size() -> int:
    return sum(4 * math.prod(shape) for shape in maxtext_tensors().values())


def write_random(path: Path, size: int, rng: np.random.Generator) -> None:
    """`size` incompressible bytes, generated and written in 64 MiB blocks."""
    with open(path, "wb") as f:
        for offset in range(0, size, 64 * MiB):
            n = min(64 * MiB, size - offset)
            f.write(rng.bit_generator.random_raw((n + 7) // 8).tobytes()[:n])


def write_checkpoint(root: Path, size: int) -> int:
    """A `plain` zarr MaxText checkpoint of about `size` bytes under root/0; returns its file count.

    One directory per tensor with `.zarray` and chunk files named by index; tensors of 16 MiB or
    more (at full size) are split into 16 chunks along their first axis, like the conversion's
    16 simulated devices write them.
    """
    tensors, scale = maxtext_tensors(), size / full_size()
    rng = np.random.Generator(np.random.PCG64(20260101))
    items = root / "0" / "items"
    items.mkdir(parents=True)
    (root / "0" / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {"items": "PyTreeCheckpointHandler"}}')
    (root / "0" / "commit_success.txt").write_text("Checkpoint commit was successful to 0\n")
    (items / "_METADATA").write_text(json.dumps({"tree_metadata": sorted(tensors)}))
    (items / "_sharding").write_text(json.dumps({name: "replicated" for name in tensors}))
    files = 4
    for name, shape in tensors.items():
        full_bytes = 4 * math.prod(shape)
        chunks = DEVICES if full_bytes >= 16 * MiB and shape[0] >= DEVICES else 1
        chunk_shape = [shape[0] // chunks, *shape[1:]]
        tensor = items / name
        tensor.mkdir()
        (tensor / ".zarray").write_text(json.dumps({
            "chunks": chunk_shape, "compressor": None, "dimension_separator": ".", "dtype": "<f4",
            "fill_value": None, "filters": None, "order": "C", "shape": shape, "zarr_format": 2}))
        chunk_bytes = max(64, round(full_bytes * scale / chunks))
        for index in range(chunks):
            write_random(tensor / ".".join([str(index)] + ["0"] * (len(shape) - 1)), chunk_bytes, rng)
        files += chunks + 1
    return files


# ----------------------------------------------------------------------------- plain tools


def relative_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def gcs_bucket(emulator: GcsEmulator):
    """The emulator's bucket through the google-cloud-storage client (anonymous)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.endpoint})
    return client.bucket(emulator.bucket)


def gcs_upload(bucket, root: Path, prefix: str, threads: int) -> None:
    def upload(rel: str) -> None:
        bucket.blob(f"{prefix}/{rel}").upload_from_filename(str(root / rel))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(upload, relative_files(root)))


def gcs_download(bucket, prefix: str, dest: Path, threads: int) -> int:
    blobs = list(bucket.client.list_blobs(bucket, prefix=f"{prefix}/"))

    def download(blob) -> None:
        target = dest / blob.name[len(prefix) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(target))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(download, blobs))
    return len(blobs)


def seconds_of(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------- table


@dataclass
class Row:
    """One step: DVC's seconds next to the plain tool's for the same bytes."""

    what: str
    dvc_s: float
    plain: str
    plain_s: float | None


def rows_table(rows: list[Row], size: int, full: int) -> str:
    """The table; the stage columns scale DVC's seconds linearly from `size` to `full`."""
    factor = full / size
    at = "" if abs(factor - 1) < 0.01 else f", x{factor:.1f} to {full / 1e9:.1f} GB"
    header = ("what", "DVC s", "DVC MB/s", "plain tool", "plain s", "DVC / plain",
              *(f"% of {name} {t} s{at}" for name, t in STAGE_SECONDS.items()))
    cells = []
    for r in rows:
        cells.append((r.what, f"{r.dvc_s:.2f}", f"{size / 1e6 / r.dvc_s:.0f}", r.plain,
                      "" if r.plain_s is None else f"{r.plain_s:.2f}",
                      "" if r.plain_s is None else f"{r.dvc_s / r.plain_s:.2f}",
                      *(f"{100 * r.dvc_s * factor / t:.1f}" for t in STAGE_SECONDS.values())))
    return markdown_table(header, cells)


# ------------------------------------------------------------------------------ measurements


def hash_rows(repo: Path, scratch: Path, checksum_jobs: list[int]) -> list[Row]:
    """`dvc add --no-commit` cold (fresh state db) per checksum_jobs, then warm, vs md5sum."""
    env = dvc_env(scratch)
    md5sum = {1: ("md5sum, serial", timed("find ckpt -type f -print0 | xargs -0 md5sum > /dev/null", repo, env)),
              CORES: (f"md5sum, xargs -P {CORES}",
                      timed(f"find ckpt -type f -print0 | xargs -0 -P {CORES} -n 8 md5sum > /dev/null", repo, env))}
    rows = []
    for jobs in checksum_jobs:
        run(dvc("config", "core.checksum_jobs", str(jobs)), repo, env)
        state_env = dvc_env(scratch / f"state-{jobs}")  # a state db that has never seen the files
        cold = timed(dvc("add", "-q", "--no-commit", "ckpt"), repo, state_env)
        rows.append(Row(f"hash cold, dvc add --no-commit, core.checksum_jobs={jobs}", cold,
                        *md5sum[1 if jobs == 1 else CORES]))
    warm = timed(dvc("add", "-q", "--no-commit", "ckpt"), repo, state_env)
    rows.append(Row(f"hash warm (state db), dvc add --no-commit, core.checksum_jobs={jobs}", warm,
                    *md5sum[1 if jobs == 1 else CORES]))
    run(dvc("config", "--unset", "core.checksum_jobs"), repo, env)
    return rows


def cache_rows(repo: Path, scratch: Path) -> list[Row]:
    """`dvc commit` into an empty cache and `dvc checkout` of a deleted workspace, per cache type."""
    env, rows = dvc_env(scratch), []
    base = scratch / "plain-base"
    run(["cp", "-al", "ckpt", str(base)], repo, env)
    for cache_type, plain in (("copy", "cp -r"), ("hardlink,copy", "cp -al")):
        run(dvc("config", "cache.type", cache_type), repo, env)
        shutil.rmtree(repo / ".dvc" / "cache", ignore_errors=True)
        commit = timed(dvc("commit", "-q", "-f", "ckpt.dvc"), repo, env)
        copy = scratch / "plain-copy"
        plain_commit = timed(f"{plain} {base} {copy}", repo, env)
        shutil.rmtree(copy)
        shutil.rmtree(repo / "ckpt")  # before the plain copy: at most 3 x the checkpoint on disk
        plain_checkout = timed(f"{plain} {base} {copy}", repo, env)
        shutil.rmtree(copy)
        checkout = timed(dvc("checkout", "-q", "ckpt.dvc"), repo, env)
        rows += [Row(f"commit into cache, dvc commit, cache.type {cache_type}", commit, plain, plain_commit),
                 Row(f"checkout from cache, dvc checkout, cache.type {cache_type}", checkout, plain, plain_checkout)]
    shutil.rmtree(base)
    return rows


def remote_rows(repo: Path, scratch: Path, jobs: int) -> list[Row]:
    """Push, status -c and pull against a fresh emulator, DVC with -j `jobs`, the client on as many threads."""
    env = dvc_env(scratch)
    data = scratch / f"gcs-{jobs}"
    with running_emulator(data) as emulator:
        bucket = gcs_bucket(emulator)
        add_dvc_remote(repo, emulator, env, name=f"j{jobs}", prefix=f"dvc-j{jobs}")
        remote = ["-r", f"j{jobs}", "-j", str(jobs)]
        progress(f"-j {jobs}: plain upload, dvc push")
        plain_push = seconds_of(lambda: gcs_upload(bucket, repo / "ckpt", "plain", jobs))
        push = timed(dvc("push", "-q", *remote, "ckpt.dvc"), repo, env)
        plain_list = seconds_of(lambda: list(bucket.client.list_blobs(bucket, prefix="plain/")))
        status = timed(dvc("status", "-q", "-c", "-r", f"j{jobs}", "ckpt.dvc"), repo, env)
        progress(f"-j {jobs}: plain download, dvc pull")
        shutil.rmtree(repo / "ckpt")  # first: at most 3 x the checkpoint on disk
        shutil.rmtree(repo / ".dvc" / "cache")
        download = scratch / "plain-download"
        plain_pull = seconds_of(lambda: gcs_download(bucket, "plain", download, jobs))
        shutil.rmtree(download)
        pull = timed(dvc("pull", "-q", *remote, "ckpt.dvc"), repo, env)
        run(dvc("remote", "remove", "--local", f"j{jobs}"), repo, env)
    shutil.rmtree(data)
    client = f"google-cloud-storage, {jobs} threads"
    return [Row(f"push to GCS emulator, dvc push -j {jobs}", push, f"{client}: upload", plain_push),
            Row("remote status, dvc status -c", status, "google-cloud-storage: list", plain_list),
            Row(f"pull from GCS emulator (+ checkout), dvc pull -j {jobs}", pull, f"{client}: download", plain_pull)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full",
                        help="checkpoint size: 'full' (gemma-3-4b float32, about 17.2 GB) or e.g. 1GiB, 256MiB")
    parser.add_argument("--jobs", default="4,16", help="comma-separated `dvc push/pull -j` values (and client threads)")
    parser.add_argument("--checksum-jobs", default=f"1,{max(2, CORES)}",
                        help="comma-separated core.checksum_jobs values for the cold hash (DVC's default here: "
                             f"{max(1, min(4, CORES // 2))})")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    full = full_size()
    size = full if args.size == "full" else parse_size(args.size)
    need = int(FREE_DISK_FACTOR * size) + GiB
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        raise SystemExit(f"--size {size / GiB:.2f} GiB needs {need / GiB:.1f} GiB free in {args.workdir} "
                         f"({FREE_DISK_FACTOR} x the checkpoint + 1 GiB), only {free / GiB:.1f} GiB: "
                         "pass a smaller --size or another --workdir")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_realsize_", dir=args.workdir) as tmp:
        scratch = Path(tmp)
        repo = scratch / "repo"
        make_repo(repo, dvc_env(scratch))
        progress(f"writing a {size / GiB:.2f} GiB gemma-3-4b-shaped checkpoint")
        files = write_checkpoint(repo / "ckpt", size)
        actual = disk_used(repo / "ckpt")
        progress(f"{files} files, {actual / GiB:.2f} GiB; hashing")
        rows = hash_rows(repo, scratch, [int(j) for j in args.checksum_jobs.split(",")])
        progress("commit and checkout per cache type")
        rows += cache_rows(repo, scratch)
        for jobs in [int(j) for j in args.jobs.split(",")]:
            progress(f"measured so far (the remote rows take minutes: see docs/remote-and-cache.md):\n"
                     f"{rows_table(rows, actual, full)}")
            rows += remote_rows(repo, scratch, jobs)
    print(f"checkpoint: {files} files, {actual / 1e9:.2f} GB ({actual / full:.3f} of gemma-3-4b float32, "
          f"{full / 1e9:.1f} GB); {CORES} cores; benchmark wall time {time.perf_counter() - started:.0f} s\n")
    print(rows_table(rows, actual, full))


if __name__ == "__main__":
    main()
