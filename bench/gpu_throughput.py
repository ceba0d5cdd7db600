"""Offline throughput and batch-1 decode against the weight-reading bound (step 4 of bench/gpu_check.py).

    python -m bench.gpu_throughput [--smoke] [--cache DIR]

A random ~1.1B Llama (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads, 32k vocab) in
bfloat16 runs the `main` workload (the anchors' 64 requests, bench/harness/workload.py) through streamer and
through transformers' `generate` (static batches of 16) in the same run. Then one request decodes
alone: its time per token after the first is set against the time to read every weight once at the
measured device-to-device copy bandwidth (weights' bytes / copy bandwidth), the bound of a
memory-bound decode. --smoke: a tiny Llama on the CPU, 8 of the requests cut short.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness.workload import ANCHOR_VOCAB, Workload, anchor_main
from bench.throughput import run_hf, run_streamer
from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint


def spec(smoke: bool) -> TinyModelSpec:
    if smoke:
        return TinyModelSpec(arch="llama", vocab_size=ANCHOR_VOCAB, max_position_embeddings=1024)
    return TinyModelSpec(arch="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=ANCHOR_VOCAB,
                         max_position_embeddings=2048)


def workload(smoke: bool) -> Workload:
    reqs = anchor_main()
    if smoke:  # the interpreter-free CPU path is still slow on 2 cores: a few short requests
        reqs = [{"prompt": r["prompt"][:48], "max_tokens": min(r["max_tokens"], 8)} for r in reqs[:8]]
    return Workload([r["prompt"] for r in reqs], [r["max_tokens"] for r in reqs])


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy, median of 5 after a warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / sorted(times[1:])[2]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch1_decode_s(ckpt: Path, dtype: str, prompt: list[int], n: int) -> float:
    """Seconds per token of one request decoding alone, after its first token (the prefill)."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype=dtype, max_num_seqs=1))
    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("one", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        first = first or time.perf_counter()  # the first step is the prefill, which samples token 1
    return (time.perf_counter() - first) / (n - 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 8 short requests")
    parser.add_argument("--cache", type=Path, default=None, help="keep the random checkpoint here")
    args = parser.parse_args()
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        path = (args.cache or Path(tmp)) / ("llama-tiny-32k" if args.smoke else "llama-1b-random")
        start = time.perf_counter()
        ckpt = path if (path / "config.json").exists() else build_checkpoint(path, spec(args.smoke), dtype=dtype)
        print(f"checkpoint {path.name} ready in {time.perf_counter() - start:.1f} s", flush=True)
        weight_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        work = workload(args.smoke)
        ours = run_streamer(ckpt, work, dtype, max_num_seqs=256, max_batched=2048)
        hf = run_hf(ckpt, work, dtype, batch=16, device=device)
        bw = copy_bandwidth(device, (16 << 20) if args.smoke else (1 << 30))
        per_token = batch1_decode_s(ckpt, dtype, work.prompts[0][:32], 8 if args.smoke else 128)
    bound = weight_bytes / bw
    result = {"ok": True, "dtype": dtype, "weights_bytes": weight_bytes, "streamer": ours, "transformers": hf,
              "copy_bandwidth_gbs": bw / 1e9, "batch1_decode_ms": 1e3 * per_token, "weight_read_bound_ms": 1e3 * bound}
    ratio = ours["tok_per_s"] / hf["tok_per_s"]
    result["summary"] = (f"{ours['tok_per_s']:.0f} vs transformers {hf['tok_per_s']:.0f} tok/s ({ratio:.2f}x); "
                         f"batch-1 decode {1e3 * per_token:.2f} ms/token, "
                         f"bound {1e3 * bound:.2f} ms ({bound / per_token:.0%} of it; copy {bw / 1e9:.0f} GB/s)")
    print(result["summary"])
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
