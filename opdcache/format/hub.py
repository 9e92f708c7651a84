"""Sharing caches on the Hugging Face Hub with the real ``huggingface_hub`` client.

``push`` validates the cache in full (every row-level check), uploads the shards and side files with the client's resumable folder upload
(``upload_large_folder`` before huggingface_hub 2, ``upload_folder`` from 2 on, which resumes by itself),
then the dataset card and, last, the manifest, so a reader never sees a manifest that lists shards not yet
uploaded. ``pull`` downloads a snapshot and validates it. The token comes from ``HF_TOKEN`` or the stored
login and is never printed or written anywhere by opdcache.
"""

from __future__ import annotations

from pathlib import Path

from opdcache.errors import OpdcacheError
from opdcache.format import manifest as M

_LAST = ("README.md", M.MANIFEST_NAME)


class HubError(OpdcacheError, RuntimeError):
    """A push or pull could not complete."""


def _hub_failure(what: str, repo_id: str, exc: Exception) -> HubError:
    """One line for a failed Hub call: what failed, the client's own first line, and what to do."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return HubError(f"{what} {repo_id} failed: {type(exc).__name__}: {first}. Check the network, HF_TOKEN (or `hf auth login`) "
                    "and the repo id; rerun the same command to resume")


def _api(token: str | None):
    from huggingface_hub import HfApi

    return HfApi(token=token)


def push(root: str | Path, repo_id: str, private: bool = False, token: str | None = None, revision: str | None = None) -> str:
    """Upload a valid cache to a Hub dataset repo; return the repo URL."""
    from opdcache.format import card
    from opdcache.format.validate import validate

    from opdcache import storage

    source = storage.as_path(root)
    # the Hub client uploads local folders: an object-store cache is downloaded first, into a folder gone at the end
    with storage.local_copy(source) as local:
        errors = [p for p in validate(local) if not p.warning]  # the full check: nothing corrupt leaves this machine
        if errors:
            raise HubError(f"refusing to push an invalid cache ({len(errors)} problems; first: {errors[0]}); "
                           f"run `opdcache validate {root}`")
        manifest = M.load(local)
        card.write(local, manifest)
        api = _api(token)
        try:
            url = _upload(api, local, repo_id, private, revision)
        except Exception as exc:  # the client's network, auth and HTTP errors have no common base class
            raise _hub_failure("push to", repo_id, exc) from exc
    return str(url)


def _upload(api, root: Path, repo_id: str, private: bool, revision: str | None):
    url = api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    ignore = list(_LAST) + [".*", "**/.*", "**/_opdcache_job.json"]
    if hasattr(api, "upload_large_folder"):  # huggingface_hub < 2: the resumable multi-commit uploader
        api.upload_large_folder(repo_id=repo_id, folder_path=str(root), repo_type="dataset", revision=revision, ignore_patterns=ignore)
    else:  # huggingface_hub >= 2: upload_folder itself resumes (committed files skipped, data deduplicated)
        api.upload_folder(repo_id=repo_id, folder_path=str(root), repo_type="dataset", revision=revision, ignore_patterns=ignore,
                          commit_message="opdcache: shards")
    for name in _LAST:  # card, then the manifest: its presence on the Hub means the upload is complete
        api.upload_file(path_or_fileobj=str(root / name), path_in_repo=name, repo_id=repo_id, repo_type="dataset",
                        revision=revision, commit_message=f"opdcache: {name}")
    return url


def pull(repo_id: str, out: str | Path, token: str | None = None, revision: str | None = None) -> Path:
    """Download a cache from the Hub into ``out`` and validate it; raise if it is incomplete or corrupt."""
    from huggingface_hub import snapshot_download

    from opdcache.format.validate import validate

    out = Path(out)
    try:
        snapshot_download(repo_id=repo_id, repo_type="dataset", local_dir=str(out), token=token, revision=revision)
    except Exception as exc:
        raise _hub_failure("pull of", repo_id, exc) from exc
    errors = [p for p in validate(out) if not p.warning]
    if errors:
        raise HubError(f"downloaded cache {repo_id} is invalid ({len(errors)} problems; first: {errors[0]})")
    return out
