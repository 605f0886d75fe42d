# syntax=docker/dockerfile:1
# The torchjobs image: the migration job, the API server and the workers of docker-compose.yml
# all run it, with different commands. Built and run by nobody here (this environment has no
# Docker); tests/test_deployment.py checks it and the compose file statically.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in a layer of its own: it is by far the largest and changes the least.
# The pin is the version CI tests with. In a real GPU image use a CUDA build of torch that
# matches the hosts' NVIDIA driver (PyTorch's CUDA wheel index, or a pytorch/pytorch or
# nvidia/cuda base image); on a CPU-only wheel the workers can only run `--accelerator cpu`.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY workers ./workers
COPY migrations ./migrations
# Editable, so that `torchjobs db upgrade` finds /app/migrations beside the package. pip
# compiles what it installs; our own packages are compiled here, since PYTHONDONTWRITEBYTECODE
# (above) means no process ever writes their .pyc and each would compile them from source.
RUN pip install -e . \
 && python -m compileall -q service workers migrations \
 && useradd --create-home --uid 10001 torchjobs \
 && mkdir -p /data /checkpoints /scripts \
 && chown torchjobs:torchjobs /data /checkpoints /scripts

USER torchjobs
ENV TORCHJOBS_HOME=/data
EXPOSE 8000
ENTRYPOINT ["torchjobs"]
CMD ["server", "--host", "0.0.0.0", "--port", "8000"]
