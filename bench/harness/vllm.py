"""How vLLM's CPU build runs beside streamer: the same settings in every side-by-side benchmark."""

from __future__ import annotations

import os
from pathlib import Path

from workers.allocator import find_tcmalloc

# vLLM's best settings per workload on 2 cores (the anchors' README): both cores bound,
# tcmalloc + Intel OpenMP preloaded, prefix caching with 32-token blocks for the shared prefix.
VLLM_FLAGS = {
    "main": ["--bind", "0-1", "--preload", "tcmalloc+iomp"],
    "chat": ["--bind", "0-1", "--preload", "tcmalloc+iomp", "--prefix-caching", "on", "--block-size", "32"],
    "prefill": ["--bind", "0-1", "--preload", "tcmalloc+iomp"],
    "sampled": ["--bind", "0-1", "--preload", "tcmalloc+iomp", "--workload", "main"],
}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
# Runs the anchors' bench_vllm.py (its path first in argv) with its one greedy SamplingParams made
# the sampled workload's, so vLLM is configured exactly as for the greedy workloads.
VLLM_SAMPLED = f"""
import sys
path = sys.argv[1]
source = open(path).read()
greedy = "SamplingParams(temperature=0.0,"
assert source.count(greedy) == 1, "bench_vllm.py changed: its greedy SamplingParams is not where expected"
source = source.replace(greedy, "SamplingParams(temperature={SAMPLED['temperature']}, top_p={SAMPLED['top_p']}, "
                                "top_k={SAMPLED['top_k']},")
sys.argv = sys.argv[1:]
exec(compile(source, path, "exec"), {{"__name__": "__main__", "__file__": path}})
"""

# Runs bench_vllm.py (its path first in argv) with LoRA on: vLLM's `enable_lora` with `max_loras` and
# `max_lora_rank` as the engine under test, request i under adapter i mod N of the JSON list of
# [name, folder] pairs in STREAMER_BENCH_LORAS; its warm-up requests too, so adapters load untimed.
VLLM_LORA = """
import json, os, sys
path = sys.argv[1]
source = open(path).read()
loras = json.loads(os.environ["STREAMER_BENCH_LORAS"])
rank = int(os.environ["STREAMER_BENCH_LORA_RANK"])
build, generate = "    llm = LLM(**kw)", "outs = llm.generate(prompts, sps, use_tqdm=False)"
assert source.count(build) == 1 and source.count(generate) == 1, "bench_vllm.py changed"
lora_kw = f"kw.update(enable_lora=True, max_loras={len(loras)}, max_lora_rank={rank})"
source = source.replace(build, f"    {lora_kw}\\n{build}")
source = source.replace(generate, "outs = llm.generate(prompts, sps, use_tqdm=False, lora_request=["
                        "_lora(i) for i in range(len(prompts))])")
def _lora(i):  # vllm imported only once bench_vllm.py has set its environment
    from vllm.lora.request import LoRARequest
    name, folder = loras[i % len(loras)]
    return LoRARequest(name, i % len(loras) + 1, folder)
sys.argv = sys.argv[1:]
exec(compile(source, path, "exec"), {"__name__": "__main__", "__file__": path, "_lora": _lora})
"""


def server_env(vllm_python: str, work: Path) -> dict[str, str]:
    """The environment of vLLM's OpenAI server, tuned as for the offline runs: both cores bound,
    tcmalloc and the venv's Intel OpenMP preloaded; its caches in `work`, offline."""
    venv = Path(vllm_python).resolve().parents[1]
    preload = [p for p in (find_tcmalloc(), str(venv / "lib" / "libiomp5.so")) if p]
    return {**os.environ, "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
