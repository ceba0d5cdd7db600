"""A checkpoint's Hugging Face config, resolved by transformers once and then read back from a cache.

Resolving a config goes through the architecture's config class, and importing that class pulls in
transformers' kernel hub and torch.distributed.tensor: about a second of a four-second worker start,
paid again by the tokenizer (AutoTokenizer resolves the config too unless it is handed one). The
resolved config (every attribute, defaults filled in, as `to_json_string(use_diff=False)` writes it)
is saved on first load; later loads read it as a plain `PretrainedConfig`, which has the same
attributes without those imports. The cache key is the bytes of config.json and the transformers
version, so an edited config or an upgrade resolves again. A cache that cannot be written only
costs the second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from streamer.cache_dir import cache_dir

log = logging.getLogger("streamer.engine")

_FORMAT = 2  # what a cache entry holds; 2: the config class's attribute aliases as well


def cached_config_path(root: Path) -> Path:
    import transformers

    raw = (root / "config.json").read_bytes()
    # _FORMAT: entries written by an older streamer (without the aliases) are resolved again.
    key = hashlib.sha256(f"{transformers.__version__}\0{_FORMAT}\0".encode() + raw).hexdigest()[:40]
    return cache_dir() / "configs" / f"{key}.json"


def load_hf_config(root: Path) -> Any:
    """The checkpoint's config: from the cache when this exact config.json was resolved before."""
    from transformers import AutoConfig, PretrainedConfig

    cached = cached_config_path(root)
    try:
        return PretrainedConfig.from_dict(json.loads(cached.read_text()))
    except (OSError, ValueError):
        pass  # not resolved yet (or a damaged entry): resolve it now
    hf = AutoConfig.from_pretrained(str(root))
    resolved = json.loads(hf.to_json_string(use_diff=False))
    # A config class's aliases (Qwen3-MoE's and Mixtral's num_experts for num_local_experts) live in
    # its attribute_map, which a plain PretrainedConfig lacks: each alias is saved as an attribute too.
    for alias, name in getattr(hf, "attribute_map", {}).items():
        if name in resolved:
            resolved.setdefault(alias, resolved[name])
    _save(cached, json.dumps(resolved, indent=2, sort_keys=True))
    return hf


def _save(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a worker starting at the same time never reads half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        log.info("could not cache the resolved config in %s (%s): the next start resolves it again", path, e)
