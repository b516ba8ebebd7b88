"""Where the ``config.json`` of ``--model hf:...`` comes from: a path (the file, or a directory
holding one), else a Hugging Face model id ``ORG/NAME[@REVISION]`` looked up in the local
Hugging Face cache, else, when the user's environment lets the Hub be reached, that one file
downloaded through ``huggingface_hub``. Only ``config.json`` is ever fetched: no weights, no
code.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tfcli.errors import TfcliError

MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few kB; refuse anything absurd before reading
NEEDS_TRANSFORMERS = ("needs Transformers: pip install 'transformers>=4.45' (the 'hf' extra; "
                      "from tfcli's clone: pip install '.[hf]')")
REVISION = re.compile(r"[\w.\-/]+")  # a branch, tag or commit; git forbids ".." in any of them
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub reads as true


@dataclass(frozen=True)
class ConfigSource:
    path: Path
    origin: str  # "path", "cache" (the Hugging Face cache) or "hub" (downloaded just now)


def hub_offline() -> str | None:
    """The variable by which the user's environment keeps the Hub offline, read as
    huggingface_hub reads it, or None. Call it before anything tfcli asks of Transformers,
    which forces the Hub offline."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:  # the first one given decides, as in huggingface_hub
            return name if value.upper() in TRUE_VALUES else None
    return None


def hub_cache() -> str:
    """The Hugging Face cache folder from the environment as it is now: huggingface_hub reads
    it once, when first imported, so a later change (a library user's, a test's) would be
    missed if the folder were left to it."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home,
                                                                                      "hub")
    return os.path.expandvars(os.path.expanduser(cache))


def config_source(text: str, offline: str | None) -> ConfigSource:
    """The config.json that ``hf:TEXT`` names. A path that exists wins over a model id of the
    same spelling; ``offline`` (the variable hub_offline names) forbids the one download."""
    path = Path(text)
    repo_id, _, revision = text.partition("@")
    if path.exists() or not _looks_like_id(repo_id):
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise TfcliError(f"--model hf:{text}: no such file {str(file)!r} (give a "
                             f"config.json, a directory holding one, or a Hugging Face model "
                             f"id ORG/NAME[@REVISION])")
        return ConfigSource(_sized(file, text), "path")
    if "@" in text and not (REVISION.fullmatch(revision) and ".." not in revision):
        raise TfcliError(f"--model hf:{text}: {revision!r} is not a revision; after @ give a "
                         f"branch, tag or commit hash, e.g. hf:{repo_id}@main")
    return _from_hub(text, repo_id, revision or None, offline)


def _sized(path: Path, text: str) -> Path:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise TfcliError(f"--model hf:{text}: {path.stat().st_size:,} bytes is not a "
                         f"config.json (at most {MAX_CONFIG_BYTES:,})")
    return path


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise TfcliError(f"--model hf:ORG/NAME: {NEEDS_TRANSFORMERS}") from None
    return huggingface_hub


def _looks_like_id(repo_id: str) -> bool:
    """ORG/NAME as the Hub spells ids; a name ending in .json is taken for a mistyped file,
    never sent to the Hub."""
    if repo_id.count("/") != 1 or repo_id.lower().endswith(".json"):
        return False
    _hub()
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def _from_hub(text: str, repo_id: str, revision: str | None,
              offline: str | None) -> ConfigSource:
    hub = _hub()
    cache = hub_cache()
    found = hub.try_to_load_from_cache(repo_id, "config.json", cache_dir=cache,
                                       revision=revision)
    if isinstance(found, str):
        return ConfigSource(_sized(Path(found), text), "cache")
    if not offline:
        return ConfigSource(_sized(Path(_download(hub, text, repo_id, revision, cache)), text),
                            "hub")
    where = f"the local Hugging Face cache {cache}"
    if found is not None:  # an earlier download recorded that there is none
        raise TfcliError(f"--model hf:{text}: {where} records that {repo_id} has no "
                         f"config.json{f' at {revision}' if revision else ''}, so it is not a "
                         f"Transformers model; give a config.json path")
    fetch = f"hf download {repo_id} config.json" + (f" --revision {revision}" if revision else "")
    if revision and isinstance(hub.try_to_load_from_cache(repo_id, "config.json",
                                                          cache_dir=cache), str):
        raise TfcliError(f"--model hf:{text}: revision {revision!r} of {repo_id} is not in "
                         f"{where} (main is), and {offline} is set; drop @{revision}, or "
                         f"download it with `{fetch}`")
    raise TfcliError(f"--model hf:{text}: no such path, {repo_id} is not in {where}, and "
                     f"{offline} is set; download its config with `{fetch}`, or give a "
                     f"config.json path")


def _download(hub, text: str, repo_id: str, revision: str | None, cache: str) -> str:
    """config.json alone, through huggingface_hub; each way it fails is one line saying what to
    do."""
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                       LocalEntryNotFoundError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    from tfcli.subjects.base import error_text

    at = f" at {revision}" if revision else ""
    login = "log in with `hf auth login` (or set HF_TOKEN)"
    unreachable = (f"no such path, {repo_id} is not in the local Hugging Face cache {cache}, "
                   f"and the Hub could not be reached")
    host = _hub_host(hub)
    if host is not None:
        raise TfcliError(f"--model hf:{text}: {unreachable} ({host} does not resolve); check "
                         f"the connection and the id, or give a config.json path")
    import logging

    # huggingface_hub logs each retry of a failed request ("Retrying in 1s [Retry 1/5]"): the
    # failure is said once, below
    hub_log = logging.getLogger("huggingface_hub")
    level, hub_log.level = hub_log.level, logging.ERROR
    try:
        return hub.hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache)
    except GatedRepoError:
        message = (f"{repo_id} is gated: accept its terms on https://huggingface.co/{repo_id} "
                   f"with your account, then {login}")
    except RepositoryNotFoundError:
        message = (f"the Hugging Face Hub has no model {repo_id}, or it is private: check the "
                   f"id, or {login} with an account that may read it")
    except RevisionNotFoundError:
        message = (f"{repo_id} has no revision {revision!r} on the Hugging Face Hub; give a "
                   f"branch, tag or commit hash of it")
    except LocalEntryNotFoundError:  # the Hub could not be reached (before EntryNotFoundError)
        message = f"{unreachable}; check the connection and the id, or give a config.json path"
    except EntryNotFoundError:
        message = (f"{repo_id} has no config.json{at} on the Hugging Face Hub, so it is not a "
                   f"Transformers model; give a config.json path")
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        message = (f"the Hugging Face Hub refused config.json of {repo_id} (HTTP {status}); "
                   + (login if status in (401, 403) else "try again later"))
    except Exception as error:  # a proxy, a full disk, a read-only cache
        message = f"fetching config.json of {repo_id}{at} failed: {error_text(error)}"
    finally:
        hub_log.setLevel(level)
    raise TfcliError(f"--model hf:{text}: {message}")


def _hub_host(hub) -> str | None:
    """The Hub's host name when it does not resolve (no network, no DNS), else None: asked
    once here, where huggingface_hub would try five times over about 20 s."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(hub.constants.ENDPOINT).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):  # gaierror, or a lookup refused some other way
        return host
    return None
