"""Where models, tokenizers and data sets come from: a local folder, the Hugging Face cache or the Hub. When the Hub
cannot serve a name, an error says so at once and what to pass (instead of the loaders' minutes of retries)."""

import os

import datasets

def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hub answers at all (one request, no retries): False at once when HF_HUB_OFFLINE is set."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # any failure to connect: DNS, refused, timeout, proxy, TLS
        return False
    return True


def require_sources(model_args) -> None:
    """`require_source` for --model_name_or_path and --tokenizer_name (any recipe's model arguments)."""
    require_source(model_args.model_name_or_path, "--model_name_or_path", model_args.cache_dir)
    require_source(model_args.tokenizer_name, "--tokenizer_name", model_args.cache_dir)


def require_source(name: str | None, flag: str, cache_dir: str | None = None) -> None:
    """A model or tokenizer name must be a folder, a Hub id already in the cache, or a Hub id with the Hub reachable;
    else a ValueError at once that says so and what to pass (instead of the loaders' minutes of retries, then an
    error about a missing file)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if name is None or os.path.isdir(name):
        return
    files = ("config.json", "tokenizer_config.json", "vocab.txt", "tokenizer.json")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ValueError(f"{flag} {name!r}: no such folder (a Hub id has the form 'name' or 'owner/name')")
    try:
        if any(isinstance(try_to_load_from_cache(name, f, cache_dir=cache_dir), str) for f in files):
            return
    except ValueError as error:  # huggingface_hub's word on an invalid id
        raise ValueError(f"{flag} {name!r}: no such folder, and not a Hub id ({error})") from None
    if hub_reachable():
        return
    hub = f"the Hub ({constants.ENDPOINT}) could not be reached"
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else hub
    raise ValueError(
        f"{flag} {name!r} is not a local folder and not in the Hugging Face cache, and cannot be downloaded ({why}): "
        f"pass {flag} a local folder holding the model's files (config.json, model.safetensors, the tokenizer's "
        "files: a folder written by save_pretrained, or a copy of the Hub repository), or connect to download it once"
    )


def load_hub_dataset(name: str, config: str | None, cache_dir: str | None) -> datasets.DatasetDict:
    """A data set from the Hub, or from the cache when offline; when neither can serve it, a ValueError saying at once
    that the data must be given as files (instead of the loaders' minute of retries)."""
    from huggingface_hub import constants

    advice = "give the data as files instead: --train_file, --validation_file, --test_file"
    if not constants.HF_HUB_OFFLINE and not hub_reachable():
        raise ValueError(f"the Hub ({constants.ENDPOINT}) cannot be reached to download the data set {name!r}: "
                         f"{advice} (or set HF_HUB_OFFLINE=1 to use a copy already in the cache)")
    try:
        return datasets.load_dataset(name, config, cache_dir=cache_dir)
    except ConnectionError as error:
        if not constants.HF_HUB_OFFLINE:
            raise
        raise ValueError(f"HF_HUB_OFFLINE is set and the data set {name!r} is not in the cache: {advice}") from error
