"""The checkpoint's own sampling defaults (its generation_config.json), for requests that leave a
parameter out: what vLLM's server applies. A 135M chat model answers well at its recommended
temperature and badly at OpenAI's default of 1.0."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from streamer.sampling_params import SamplingParams

log = logging.getLogger("streamer.engine")
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(root: Path) -> dict[str, Any]:
    """The sampling parameters `root/generation_config.json` sets (transformers writes only what
    differs from its own defaults, so each one found is the model author's choice); {} without
    the file. Values a request could not carry are left out, with a warning."""
    path = root / "generation_config.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): no sampling defaults from it", path, e)
        return {}
    defaults = {k: data[k] for k in KEYS if k in data}
    try:
        SamplingParams.from_dict(defaults)
    except (TypeError, ValueError) as e:
        log.warning("%s: sampling defaults ignored (%s)", path, e)
        return {}
    return defaults
